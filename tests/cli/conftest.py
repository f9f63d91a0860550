"""The command tests' fixtures; they live in live_chat.py, which the tests also import by that name."""
from live_chat import served, state_dir, tiny_model  # noqa: F401
