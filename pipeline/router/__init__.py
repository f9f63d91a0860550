"""A router in front of several daemons: prefix-aware, load-bounded routing, health, and failover."""
