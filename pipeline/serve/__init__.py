"""The daemon side: socket and HTTP servers, supervisor, backends."""
