"""The engine and every backend the daemon can serve with: the `Backend` protocol, the offline `LLM`, the
engine loop, the in-process backend, and the stage processes as a backend (multiprocess.py, with their
supervision and their rings)."""
