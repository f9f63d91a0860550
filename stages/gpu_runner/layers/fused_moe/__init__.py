"""The mixture-of-experts layer: the router's top-k choice, the experts run over the tokens grouped by expert, and the block that joins them."""
