"""How tools/bench/bench_overhead.py streams a batch from a daemon: over the socket (one connection per
request, or all on one read in batches), or as Server-Sent Events over HTTP; with the CPU time of the
daemon's processes and this one sampled meanwhile."""
from __future__ import annotations

import asyncio
import json
import os
import time
from array import array

import numpy as np
from overhead_analysis import CpuSample
from overhead_daemons import Daemon

from pipeline.bench.daemon import cpu_s
from pipeline.client import AsyncClient
from stages.contracts.params import SamplingParams

CPU_SAMPLE_S = 0.05
STRUCTURED_SCHEMA = json.dumps({"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "maxLength": 16},
                                     "kind": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "kind", "ok"], "additionalProperties": False}})


async def sample_cpu(daemon: Daemon, samples: list[CpuSample]) -> None:
    """Every CPU_SAMPLE_S, the CPU time of the daemon's processes and this one (the clients)."""
    pids = dict(daemon.pids, client=os.getpid())
    while True:
        samples.append(CpuSample(time.monotonic_ns(), {name: cpu_s(pid) for name, pid in pids.items()}))
        await asyncio.sleep(CPU_SAMPLE_S)


async def stream_batch(daemon: Daemon, prompts: list[list[int]], num_steps: int, multiplex: bool,
                       num_constrained: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[CpuSample]]:
    """Streams one request per prompt at once (all on one connection, read in batches, when
    `multiplex`), the first `num_constrained` with STRUCTURED_SCHEMA; returns every token's receive
    time, id and request index, and the CPU samples taken meanwhile."""
    # Flat arrays, not a list of tuples: objects the collector must walk make its pauses grow.
    # Per delta its request and token count, per read its time and token count: the clients'
    # own work, not this recording, should be what the client column measures.
    received_ids, delta_req, delta_len = array("q"), array("q"), array("q")
    read_ns, read_len = array("q"), array("q")
    samples: list[CpuSample] = []
    params = SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=num_steps, temperature=0.0, ignore_eos=True, json_schema=STRUCTURED_SCHEMA)
    params_of = [constrained if index < num_constrained else params for index in range(len(prompts))]
    client = AsyncClient(daemon.socket_path, multiplex=multiplex)

    async def one(index: int, prompt: list[int]) -> None:
        async for delta in client.stream(prompt, params_of[index]):
            received_ids.extend(delta.token_ids)
            delta_req.append(index)
            delta_len.append(len(delta.token_ids))
            read_ns.append(time.monotonic_ns())
            read_len.append(len(delta.token_ids))

    async def all_in_batches() -> None:
        async with client.stream_batches(prompts, params_of) as batches:
            async for batch in batches:
                read_ns.append(time.monotonic_ns())
                before = len(received_ids)
                for index, delta in batch:
                    received_ids.extend(delta.token_ids)
                    delta_req.append(index)
                    delta_len.append(len(delta.token_ids))
                read_len.append(len(received_ids) - before)

    sampler = asyncio.ensure_future(sample_cpu(daemon, samples))
    try:
        if multiplex:
            await all_in_batches()
        else:
            await asyncio.gather(*(one(index, prompt) for index, prompt in enumerate(prompts)))
    finally:
        sampler.cancel()
        await client.close()
    return (np.repeat(np.frombuffer(read_ns, np.int64), np.frombuffer(read_len, np.int64)),
            np.frombuffer(received_ids, np.int64),
            np.repeat(np.frombuffer(delta_req, np.int64), np.frombuffer(delta_len, np.int64)), samples)


class SseStream(asyncio.Protocol):
    """One streamed `/v1/completions` request on a connection of its own, read as bytes: how many
    `data: {` frames came. Nothing is parsed but the status line."""

    FRAME = b"data: {"
    END = b"data: [DONE]"

    def __init__(self, request: bytes, index: int) -> None:
        self.request, self.index = request, index
        self.num_frames = 0
        self.ended: asyncio.Future = asyncio.get_running_loop().create_future()
        self._head = b""  # the response's first bytes, until the status line is checked
        self._tail = b""  # the last bytes of the previous read: a frame's mark may straddle two reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self._head is not None:
            self._head += data
            if b"\r\n" not in self._head:
                return
            if not self._head.startswith(b"HTTP/1.1 200"):
                self.ended.set_exception(RuntimeError(f"stream {self.index}: {self._head[:500]!r}"))
                return
            data, self._head = self._head, None
        seen = self._tail + data
        self.num_frames += seen.count(self.FRAME)
        self._tail = seen[-len(self.END):]
        if self.END in seen and not self.ended.done():
            self.ended.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ended.done():
            self.ended.set_exception(RuntimeError(f"stream {self.index}: the connection closed before [DONE] ({exc})"))


async def stream_http(daemon: Daemon, prompts: list[list[int]], num_steps: int) -> list[CpuSample]:
    """--http: streams one request per prompt at once from the daemon's /v1/completions, each on
    its own connection, until every one has ended with [DONE]; returns the CPU samples taken
    meanwhile. RuntimeError if a stream failed or sent no frame."""
    host, port = daemon.http_url.removeprefix("http://").rsplit(":", 1)
    samples: list[CpuSample] = []
    sampler = asyncio.ensure_future(sample_cpu(daemon, samples))
    streams, transports = [], []
    try:
        for index, prompt in enumerate(prompts):
            body = json.dumps({"prompt": prompt, "max_tokens": num_steps, "temperature": 0, "ignore_eos": True,
                               "stream": True}).encode()
            request = (b"POST /v1/completions HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%b" % (host.encode(), len(body), body))
            transport, stream = await asyncio.get_running_loop().create_connection(
                lambda: SseStream(request, index), host, int(port))
            streams.append(stream)
            transports.append(transport)
        await asyncio.gather(*(stream.ended for stream in streams))
    finally:
        sampler.cancel()
        for transport in transports:
            transport.close()
    silent = [stream.index for stream in streams if not stream.num_frames]
    if silent:
        raise RuntimeError(f"{daemon.label}: streams {silent} ended without a frame")
    return samples
