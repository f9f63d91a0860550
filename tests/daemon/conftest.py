"""The daemon tests' fixtures; they live in live_daemon.py, which the tests also import by that name."""
from live_daemon import daemon_model, live_daemon, run_dir  # noqa: F401

