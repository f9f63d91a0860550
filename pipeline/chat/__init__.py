"""`pipeline chat`: a conversation with the daemon in a terminal or over a pipe (terminal.py), its
state and commands (conversation.py), and the daemon it starts when none runs (daemon.py)."""
