"""IPC benchmark: the project's shared-memory ring against multiprocessing.Queue and pyzmq+msgspec.

Two processes (the second started with 'spawn'), 64-byte and 4 KiB messages:
  - round trip: the parent sends one message, the child echoes it back; p50/p99 in µs;
  - one way: the parent sends N messages back to back, one record (or put/send) per message,
    and the child reads them one by one, then sends one acknowledgement; messages/s is N
    divided by the time from the first send to the acknowledgement.
All transports run in one invocation, so the ratios are measured side by side.

    python tools/micro/bench_ipc.py [--quick] [--json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shm.naming import new_instance_id, unlink_instance
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment

SIZES_BYTES = (64, 4096)
RING_CAPACITY_BYTES = 1 << 20
TIMEOUT_S = 30.0
TRANSPORTS = ("ring", "mp_queue", "zmq_msgspec")


@dataclass(slots=True)
class Phase:
    """One measurement: `count` messages of `size_bytes`, echoed ("rtt") or sunk ("oneway")."""

    mode: str
    size_bytes: int
    count: int


# --- transports: each has a parent side and a child side with send(bytes) / recv() -> bytes-like


class RingEnd:
    def __init__(self, out_name: str, in_name: str) -> None:
        self.writer = RingWriter.attach(out_name)
        self.reader = RingReader.attach(in_name)

    def send(self, payload: bytes) -> None:
        self.writer.write(0, payload)

    def recv(self) -> memoryview:
        return self.reader.read(TIMEOUT_S).payload

    def close(self) -> None:
        self.writer.close()
        self.reader.close()


class QueueEnd:
    def __init__(self, out_queue: mp.Queue, in_queue: mp.Queue) -> None:
        self.out_queue = out_queue
        self.in_queue = in_queue

    def send(self, payload: bytes) -> None:
        self.out_queue.put(payload)

    def recv(self) -> bytes:
        return self.in_queue.get(timeout=TIMEOUT_S)

    def close(self) -> None:
        pass


def _zmq_message_type() -> type:
    import msgspec

    class Message(msgspec.Struct, array_like=True):
        kind: int
        data: bytes

    return Message


class ZmqEnd:
    def __init__(self, address: str, bind: bool) -> None:
        import msgspec
        import zmq

        self.message = _zmq_message_type()
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode = msgspec.msgpack.Decoder(self.message).decode
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PAIR)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # no limit: the one-way test measures the transport
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))
        if bind:
            self.socket.bind(address)
        else:
            self.socket.connect(address)

    def send(self, payload: bytes) -> None:
        self.socket.send(self.encode(self.message(0, payload)), copy=False)

    def recv(self) -> bytes:
        return self.decode(self.socket.recv(copy=False).buffer).data

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def _child(transport: str, args: tuple, phases: list[Phase]) -> None:
    """The far end: echo every message of a round-trip phase, sink every message of a one-way
    phase and acknowledge its end."""
    if transport == "ring":
        end = RingEnd(*args)
    elif transport == "mp_queue":
        end = QueueEnd(*args)
    else:
        end = ZmqEnd(args[0], bind=False)
    ack = b"k"
    for phase in phases:
        if phase.mode == "rtt":
            for _ in range(phase.count):
                end.send(end.recv())
        else:
            for _ in range(phase.count):
                end.recv()
            end.send(ack)
    end.close()


def _percentile_us(samples_ns: np.ndarray, q: float) -> float:
    return float(np.percentile(samples_ns, q) / 1000.0)


def _run_transport(transport: str, phases: list[Phase], warmup: int) -> dict[str, dict[str, float]]:
    ctx = mp.get_context("spawn")
    instance = new_instance_id()
    segments: list[RingSegment] = []
    address = ""
    if transport == "ring":
        ping = RingSegment.create(instance, "bench-ping", RING_CAPACITY_BYTES)
        pong = RingSegment.create(instance, "bench-pong", RING_CAPACITY_BYTES)
        segments = [ping, pong]
        child_args: tuple = (pong.name, ping.name)
    elif transport == "mp_queue":
        to_child, to_parent = ctx.Queue(), ctx.Queue()
        child_args = (to_parent, to_child)
    else:
        address = f"ipc://{tempfile.gettempdir()}/pipeline-bench-{os.getpid()}.sock"
        child_args = (address,)
    child = ctx.Process(target=_child, args=(transport, child_args, phases), daemon=True)
    try:
        if transport == "zmq_msgspec":
            end = ZmqEnd(address, bind=True)
        child.start()
        if transport == "ring":
            end = RingEnd(segments[0].name, segments[1].name)
        elif transport == "mp_queue":
            end = QueueEnd(to_child, to_parent)
        results: dict[str, dict[str, float]] = {}
        for phase in phases:
            payload = bytes(np.random.default_rng(phase.size_bytes).integers(0, 256, phase.size_bytes, np.uint8))
            row = results.setdefault(str(phase.size_bytes), {})
            if phase.mode == "rtt":
                samples = np.empty(phase.count, np.int64)
                clock = time.perf_counter_ns
                for i in range(phase.count):
                    start = clock()
                    end.send(payload)
                    end.recv()
                    samples[i] = clock() - start
                samples = samples[warmup:]
                row["rtt_p50_us"] = round(_percentile_us(samples, 50), 2)
                row["rtt_p99_us"] = round(_percentile_us(samples, 99), 2)
            else:
                send = end.send
                start = time.perf_counter()
                for _ in range(phase.count):
                    send(payload)
                end.recv()
                row["msgs_per_s"] = round(phase.count / (time.perf_counter() - start))
        end.close()
        child.join(TIMEOUT_S)
        return results
    finally:
        if child.is_alive():
            child.kill()
            child.join()
        for segment in segments:
            segment.close()
        unlink_instance(instance)
        if address:
            Path(address[len("ipc://"):]).unlink(missing_ok=True)


def _phases(transport: str, quick: bool) -> list[Phase]:
    rtt_count = 3_000 if quick else 20_000
    if transport == "ring":
        oneway = {64: 300_000, 4096: 100_000} if quick else {64: 2_000_000, 4096: 500_000}
    else:
        oneway = {64: 30_000, 4096: 20_000} if quick else {64: 200_000, 4096: 100_000}
    phases = []
    for size in SIZES_BYTES:
        phases.append(Phase("rtt", size, rtt_count))
        phases.append(Phase("oneway", size, oneway[size]))
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="fewer messages (under 30 s)")
    args = parser.parse_args()
    warmup = 300 if args.quick else 2_000
    results = {t: _run_transport(t, _phases(t, args.quick), warmup) for t in TRANSPORTS}
    table = sys.stderr if args.json else sys.stdout
    print(f"{'transport':<13}{'size':>6}{'rtt p50 us':>12}{'rtt p99 us':>12}{'msgs/s':>13}", file=table)
    for transport, by_size in results.items():
        for size, row in by_size.items():
            print(f"{transport:<13}{size:>6}{row['rtt_p50_us']:>12.1f}{row['rtt_p99_us']:>12.1f}"
                  f"{row['msgs_per_s']:>13,.0f}", file=table)
    for size in map(str, SIZES_BYTES):
        ring = results["ring"][size]
        print(f"ring vs zmq_msgspec at {size} B: rtt p50 {results['zmq_msgspec'][size]['rtt_p50_us'] / ring['rtt_p50_us']:.1f}x "
              f"lower, msgs/s {ring['msgs_per_s'] / results['zmq_msgspec'][size]['msgs_per_s']:.1f}x higher", file=table)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
