"""Checkpoints: what `--model` names made servable, the default model, and the tiny random ones the project makes for tests and benchmarks."""
