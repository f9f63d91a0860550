"""The engine in one process: offline `LLM`, the engine loop, the in-process backend, the `Backend` protocol."""
