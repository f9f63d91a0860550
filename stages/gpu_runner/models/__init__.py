"""Model implementations: one llama-family decoder with per-architecture switches."""
