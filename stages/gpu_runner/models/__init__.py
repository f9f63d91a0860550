"""Model families: one file each, composing the shared layers as the paper's block diagram does; config.py
reads the model's shape from its checkpoint and registry.py picks the family."""
