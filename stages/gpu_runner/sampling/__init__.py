"""Sampling in the runner: the sampler (penalties, temperature, top-k/top-p/min-p, seeds, logprobs),
the per-row metadata it reads (metadata.py), and the per-row output constraints applied before it
(grammar masks, logit bias)."""
