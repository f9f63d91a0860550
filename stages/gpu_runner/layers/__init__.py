"""What model families share: linear projections, norms, rotary, the attention layer, the gated MLP, embeddings,
and the kernels their norms and rotary run with (kernels.py)."""
