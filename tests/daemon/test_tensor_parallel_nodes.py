"""Two "machines" on loopback: the head's daemon holds rank 0, `pipeline worker` rank 1, which gets
each plan by a broadcast in the process group; the outputs equal one rank's, also when the remote
rank is killed under load (the head restarts its stages, the worker starts a fresh rank)."""
from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import REAL_BACKEND, short_dir, start_daemon, wait_for_health
from test_tensor_parallel_daemon import _assert_equal, _streams

from pipeline import LLM, SamplingParams
from pipeline.models.tiny_model import make_tiny_model

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not REAL_BACKEND, reason="tensor parallelism needs the real stage processes")]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_on_another_node_serves_what_one_rank_generates(tmp_path: Path) -> None:
    engine_device(num_devices=2)
    model = make_tiny_model(tmp_path / "qwen3", "qwen3", seed=6)
    prompts = [f"{i}: two nodes on one loopback" for i in range(4)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.8, seed=9, ignore_eos=True)] * 2
    expected = LLM(model, device=engine_device(), dtype=engine_dtype(engine_device()),
                   max_model_len=128, num_kv_blocks=64, block_size=4).generate(
        prompts, params)
    port = str(_free_port())
    rendezvous = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port]
    worker = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "worker", "--model", str(model),
                               "--node-rank", "1", *rendezvous], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    directory = short_dir()
    try:
        daemon = start_daemon(model, directory, ["--tensor-parallel-size", "2", *rendezvous, "--max-model-len", "128",
                                                 "--num-kv-blocks", "64", "--block-size", "4"])
        try:
            assert "runner1" not in asyncio.run(_health(daemon.socket_path))  # rank 1 is the worker's
            _assert_equal(asyncio.run(_streams(daemon.socket_path, prompts, params)), expected)
            before = wait_for_health(daemon.socket_path, lambda h: h.status == "ok", 10)
            rank = _rank_process(worker.pid)
            _assert_equal(asyncio.run(_streams(daemon.socket_path, prompts, params, kill_pid=rank)), expected)
            after = wait_for_health(daemon.socket_path, lambda h: h.status == "ok" and
                                    h.num_restarts == before.num_restarts + 1, 30)
            # Rank 0 saw its peer go in a collective: the failure names the rank and the group's
            # address, then gloo's own words (closed, or timed out).
            failure = str(after.last_failure)
            assert failure.startswith("stage 'runner' exited with code 1: runner: PeerLostError: tensor-parallel "
                                      f"rank 0 of 2: a peer rank left the group at 127.0.0.1:{port} ("), failure
            assert "gloo" in failure.lower(), failure
            assert _rank_process(worker.pid) != rank
        finally:
            daemon.stop()
        assert daemon.shm_entries() == []
    finally:
        worker.send_signal(signal.SIGTERM)
        output = worker.communicate(timeout=30)[0].decode()
        shutil.rmtree(directory.parent, ignore_errors=True)
    assert "node 1: running ranks 1..1 of 2 for the head at 127.0.0.1:" in output


def _rank_process(worker_pid: int, timeout_s: float = 30.0) -> int:
    """The pid of the worker's one rank process (its child that runs a spawned interpreter)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split():
            try:
                command = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"spawn_main" in command:
                return int(child)
        time.sleep(0.05)
    raise AssertionError(f"the worker {worker_pid} runs no rank after {timeout_s} s")


async def _health(socket_path: Path) -> dict[str, int]:
    from pipeline.client import AsyncClient

    client = AsyncClient(socket_path)
    try:
        return (await client.health()).stage_pids
    finally:
        await client.close()
