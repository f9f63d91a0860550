"""The daemon tests' fixtures; they live in live_daemon.py and fault_daemon.py, which the tests also
import by those names. The fault daemon's are here so that one instance serves the whole session."""
from fault_daemon import fault_load, fault_reference, fault_slot  # noqa: F401
from live_daemon import daemon_model, live_daemon, run_dir  # noqa: F401

