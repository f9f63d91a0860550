"""The profiler tests' fixtures; they live in profiled_daemon.py, which the tests also import by that name."""
from profiled_daemon import profiled_daemon  # noqa: F401
