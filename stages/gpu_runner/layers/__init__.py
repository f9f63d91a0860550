"""What model families share: linear projections, norms, rotary, the attention layer, the gated MLP, embeddings."""
