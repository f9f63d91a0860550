"""The daemon side: the Unix-socket and HTTP servers, the supervisor, the stage backend."""
