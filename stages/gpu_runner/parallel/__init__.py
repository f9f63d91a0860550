"""Tensor parallelism: the ranks' process group and collectives (group.py), and how the model is cut between them (sharding.py)."""
