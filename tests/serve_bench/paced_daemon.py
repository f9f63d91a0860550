"""PacedDaemon: the client tests' FakeDaemon, streaming with a delay per token, counting how many
requests it serves at once, and reporting speculative decoding counts that rise as requests finish."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "client"))
from fake_daemon import FakeDaemon  # noqa: E402

from pipeline.protocol import Accepted, Delta, Done, StatsReply  # noqa: E402

TOKEN_DELAY_S = 0.002


class PacedDaemon(FakeDaemon):
    """Sleeps before each Delta, so requests overlap; `peak_running` is the most accepted
    requests not yet done at one time, counted on the daemon's side of the socket. Its stats
    count `speculative_base` plus `speculative_per_request` for each request finished (drafted,
    accepted, verifications)."""

    def __init__(self, socket_path: Path, token_delay_s: float = TOKEN_DELAY_S) -> None:
        super().__init__(socket_path)
        self.token_delay_s = token_delay_s
        self.running = 0
        self.peak_running = 0
        self.num_finished = 0
        self.speculative_base = (0, 0, 0)
        self.speculative_per_request = (0, 0, 0)

    async def _send(self, writer: asyncio.StreamWriter, message: object) -> None:
        if isinstance(message, Accepted):
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
        elif isinstance(message, Delta):
            await asyncio.sleep(self.token_delay_s)
        elif isinstance(message, Done):
            self.running -= 1
            self.num_finished += 1
        elif isinstance(message, StatsReply):
            message.num_draft_tokens, message.num_accepted_tokens, message.num_verifications = (
                base + self.num_finished * each for base, each in zip(self.speculative_base, self.speculative_per_request))
        await super()._send(writer, message)
