"""Model families: one file each, composing the shared layers as the paper's block diagram does."""
