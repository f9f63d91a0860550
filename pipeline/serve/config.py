"""How the daemon serves (as opposed to how the engine runs: EngineConfig), and its version."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from pipeline.serve.supervisor import RestartPolicy
from stages.process import IDLE_TICK_S

DEFAULT_MAX_UNREAD_BYTES = 64 * 1024 * 1024
DEFAULT_GRACE_S = 30.0
MIN_STALL_S = 2 * IDLE_TICK_S
DEFAULT_STALL_S = 30.0  # generous: one CPU step of a large batch can take seconds
DEFAULT_MAX_WAITING = 1024


def version() -> str:
    try:
        return metadata.version("pipeline")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(slots=True)
class DaemonConfig:
    """How the daemon serves, as opposed to how the engine runs (EngineConfig)."""

    grace_s: float = DEFAULT_GRACE_S  # on SIGTERM, how long requests in flight may take to finish
    stall_s: float = DEFAULT_STALL_S  # the stall limit's floor; the stages' pace may raise it (stalls.py)
    max_waiting: int = DEFAULT_MAX_WAITING  # requests admitted beyond max_num_seqs
    max_restarts: int = 5  # stage restarts allowed within restart_window_s
    restart_window_s: float = 600.0
    max_unread_bytes: int = DEFAULT_MAX_UNREAD_BYTES  # per connection, before it is dropped
    http_port: int | None = None  # serve the OpenAI HTTP API on this TCP port too (0: any free port)
    http_host: str = "127.0.0.1"
    api_key: str | None = None  # if set, every /v1/* HTTP request must carry `Authorization: Bearer <key>`
    served_model_name: str | None = None  # the model's name in the HTTP API; None: the checkpoint's directory name
    # A streamed HTTP response's text goes out once this many tokens have gathered (its first
    # token and its end at once): fewer, larger Server-Sent Events, each a write to its connection.
    stream_interval: int = 1

    def check(self) -> None:
        """Raises ValueError naming the first bad value."""
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s!r}")
        if not self.stall_s >= MIN_STALL_S:
            raise ValueError(f"stall_s must be at least {MIN_STALL_S:g} s (an idle stage beats every "
                             f"{IDLE_TICK_S:g} s), got {self.stall_s!r}")
        for name in ("max_waiting", "max_unread_bytes", "stream_interval"):
            value = getattr(self, name)
            positive = name != "max_waiting"
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if positive else 0):
                raise ValueError(f"{name} must be a {'positive' if positive else 'non-negative'} "
                                 f"integer, got {value!r}")
        if self.http_port is not None and (isinstance(self.http_port, bool) or not isinstance(self.http_port, int)
                                           or not 0 <= self.http_port <= 65535):
            raise ValueError(f"http_port must be an integer in [0, 65535], got {self.http_port!r}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to serve without one)")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        self.restart_policy().check()

    def restart_policy(self) -> RestartPolicy:
        return RestartPolicy(self.max_restarts, self.restart_window_s)
