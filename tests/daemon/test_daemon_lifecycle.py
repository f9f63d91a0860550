"""The daemon's life: one per socket, `pipeline stop` leaves nothing behind, the requests in flight
when the engine fails resume on a fresh one, the CLI round trip, and the embedded default model."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import REAL_BACKEND, start_daemon

from pipeline import LLM, SamplingParams
from pipeline.client import AsyncClient, Client, Completion
from pipeline.serve.daemon import DaemonAlreadyRunning, claim_socket_path, pid_file_for
from pipeline.models.default_model import ensure_default_model
from pipeline.errors import StageFailed
from shm.naming import pid_alive

pytestmark = pytest.mark.timeout(90)


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def test_one_daemon_per_socket_and_stop_leaves_no_process_socket_or_shared_memory(daemon_model: Path,
                                                                                 run_dir: Path) -> None:
    daemon = start_daemon(daemon_model, run_dir)
    try:
        pid_file = pid_file_for(daemon.socket_path)
        assert int(pid_file.read_text()) == daemon.process.pid
        with pytest.raises(DaemonAlreadyRunning):
            claim_socket_path(daemon.socket_path)
        second = subprocess.run(
            [sys.executable, "-c", "from pipeline.cli import main; import sys; sys.exit(main())", "start",
             "--socket", str(daemon.socket_path), "--model", str(daemon_model)],
            capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and "already running" in second.stderr
        with Client(daemon.socket_path) as client:
            assert client.health().status == "ok"  # untouched by the attempt
            client.generate("warm up", {"max_tokens": 4})
        result = run_cli("stop", "--socket", str(daemon.socket_path))
        assert result.returncode == 0, result.stderr
        assert daemon.process.wait(timeout=5) == 0
        assert not pid_alive(daemon.process.pid)
        assert not daemon.socket_path.exists() and not pid_file.exists()
        assert daemon.shm_entries() == []
        result = run_cli("stop", "--socket", str(daemon.socket_path))
        assert result.returncode == 2 and "no pipeline daemon is listening" in result.stderr
    finally:
        daemon.stop()
    # A socket file nobody listens on (a daemon that was killed) is removed and reused.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(daemon.socket_path))
    stale.close()
    claim_socket_path(daemon.socket_path)
    assert not daemon.socket_path.exists()


def test_a_failed_engine_thread_resumes_every_request_but_the_one_that_fails_it_twice(daemon_model: Path,
                                                                                      run_dir: Path) -> None:
    """The in-process backend's engine thread dies taking in the request that carries the fault:
    the requests running resume on a fresh engine with an uninterrupted run's output, and the
    poison guard fails the faulty one when it kills the fresh engine too."""
    from engine_thread_backend import FAIL_PROMPT

    prompts = [f"request {i}" for i in range(4)]
    long = SamplingParams(max_tokens=240, ignore_eos=True, temperature=0.0)
    expected = LLM(daemon_model, device=engine_device(), dtype=engine_dtype(engine_device()),
                   max_model_len=2048, num_kv_blocks=512, block_size=16).generate(
        prompts, long)
    daemon = start_daemon(daemon_model, run_dir, backend="engine-thread")
    try:
        async def run() -> tuple[list[Completion | None], BaseException | None]:
            client = AsyncClient(daemon.socket_path)
            streams = [client.stream(prompt, long) for prompt in prompts]
            running = [stream.__aiter__() for stream in streams]
            await asyncio.wait_for(asyncio.gather(*(deltas.__anext__() for deltas in running)), 30)
            killer = asyncio.ensure_future(client.generate(FAIL_PROMPT, {"max_tokens": 4}))
            await asyncio.wait_for(asyncio.gather(*(_drain(deltas) for deltas in running)), 60)
            failure = (await asyncio.gather(killer, return_exceptions=True))[0]
            await client.close()
            return [stream.completion for stream in streams], failure

        completions, failure = asyncio.run(run())
        assert isinstance(failure, StageFailed), failure
        assert "the engine thread died taking in a request: RuntimeError: asked to fail" in failure.message
        assert "in flight during this crash and the one before it" in failure.message
        for completion, want in zip(completions, expected):
            assert completion is not None and completion.token_ids == want.token_ids and completion.text == want.text
        with Client(daemon.socket_path) as client:
            health = client.health()
            assert health.status == "ok" and health.num_restarts == 2, health
            stats = client.stats()
            assert stats.num_guard_failed_requests == 1 and stats.num_resumed_requests >= len(prompts) + 1
            assert client.generate("after the failure", {"max_tokens": 2}).finish_reason == "length"
    finally:
        assert daemon.stop() == 0
    assert not daemon.socket_path.exists()


async def _drain(deltas: AsyncIterator[object]) -> None:
    async for _ in deltas:
        pass


def test_cli_status_generate_stop(daemon_model: Path, run_dir: Path) -> None:
    socket_arg = ["--socket", str(run_dir / "pipeline.sock")]
    if REAL_BACKEND:
        started = run_cli("start", "--detach", "--model", str(daemon_model), "--device", engine_device(), *socket_arg,
                          timeout_s=120)
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip() == socket_arg[1]
        # A second detached daemon on the same socket is refused; the first serves on.
        refused = run_cli("start", "--detach", "--model", str(daemon_model), *socket_arg)
        assert refused.returncode == 1, refused.stderr
        daemon = None
    else:
        daemon = start_daemon(daemon_model, run_dir)
    try:
        status = run_cli("status", *socket_arg)
        assert status.returncode == 0, status.stderr
        assert "daemon: ok" in status.stdout and "KV blocks: 0 used" in status.stdout
        assert "running" in status.stdout and "tokens/s" in status.stdout
        if REAL_BACKEND:  # what the runner holds each part in, as it published it
            assert "weights: " in status.stdout and "dense dtype" in status.stdout and "KV cache" in status.stdout
        generated = run_cli("generate", *socket_arg, "The model reads", "--max-tokens", "8", "--temperature", "0")
        streamed = run_cli("generate", *socket_arg, "The model reads", "--max-tokens", "8", "--temperature", "0",
                           "--stream")
        assert generated.returncode == streamed.returncode == 0
        assert generated.stdout == streamed.stdout and generated.stdout.strip()
        bad = run_cli("generate", *socket_arg, "x", "--top-p", "2")
        assert bad.returncode == 1 and "top_p" in bad.stderr
        stopped = run_cli("stop", *socket_arg)
        assert stopped.returncode == 0, stopped.stderr
        gone = run_cli("status", *socket_arg)
        assert gone.returncode == 2 and "pipeline start" in gone.stderr
    finally:
        if daemon is not None:
            daemon.stop()


@pytest.mark.timeout(60)
def test_default_model_is_built_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = ensure_default_model()
    assert built == tmp_path / "pipeline" / "default-model"
    weights = built / "model.safetensors"
    first_mtime_ns = weights.stat().st_mtime_ns
    assert ensure_default_model() == built
    assert weights.stat().st_mtime_ns == first_mtime_ns
    assert [p.name for p in built.parent.iterdir()] == ["default-model"]  # no scratch left over
    assert os.stat(built / "config.json").st_size > 0
