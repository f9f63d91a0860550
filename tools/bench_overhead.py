"""Benchmark: does host work ever make the device wait? The real daemon on a simulated device, async vs sync.

The daemon and its stage processes are the real ones; only the model is replaced by a simulated
device (stages/gpu_runner/simulated.py) whose every step takes T ms of wall time and no CPU, so
whatever the host does shows as the device waiting. Two daemons run side by side, one with async
scheduling and one with --no-async-scheduling; in each round, for each batch size (1, 64, 256),
that many streamed requests (32-token prompts, long outputs) are sent at once to each daemon in
turn by asyncio clients in this process, one connection per request (`--multiplex`: this
checkout's requests of a batch share one connection, read as one batch of deltas per socket
read with `AsyncClient.stream_batches`; the baseline's keep one connection each, unless
`--baseline-multiplex`). In the steady window (every
row decoding, warm-up and tail cut off) it measures, per daemon and batch, the median over rounds:

  step_ms         mean wall time per step; exposed_pct = 100 * (step_ms - T) / T: device idle
  deliver_*_ms    from a step's tokens being ready on the device to a client holding them
  loop_*_ms       from a step's tokens being ready to the launch of the step planned from them
                  (async: step N+2 from step N, so it may take up to T; sync: N+1, all exposed)
  cpu_ms_per_step CPU time (utime + stime from /proc) of each process per step

`--baseline DIR` also measures the daemons of another checkout of this repository (made with
`git worktree add DIR REV`) in the same rounds: a fix's effect, side by side with the old code.
`--structured 0,0.5,1` measures, for each FRACTION, batches whose first round(FRACTION x batch)
requests are constrained by a JSON schema (STRUCTURED_SCHEMA: a long array of small objects, so
no row finishes its grammar within the run); the runner does the real grammar work per step on
the simulated device (stages/gpu_runner/simulated.py), and the table adds the grammar library's
per-token mask time (tools/bench_grammar.py). A constrained row's tokens do not name their step:
its k-th token came k steps after its first, which is placed at the latest step consistent with
every token of the row arriving after its step was ready.
`--pin` pins every thread of the scheduler and the runner to one CPU and the daemons' other
processes and the clients to a second (os.sched_setaffinity), to see what sharing CPUs costs.
`--http` streams every request as Server-Sent Events from the daemon's OpenAI API
(`/v1/completions`, one HTTP connection per request, read by a bare asyncio protocol that counts
frames), so the daemon's CPU per token is what an SSE stream costs it; `--stream-interval N`
starts this checkout's daemons with `pipeline start --stream-interval N`. A text frame does not
say which tokens it holds (a token that ends inside a character sends none), so delivery is not
measured then.
`--serve SOCKET` only starts the daemon on the simulated device and serves until Ctrl-C, to
profile it by hand (py-spy, perf); `--http-port` serves the HTTP API too.

    python tools/bench_overhead.py [--json] [--quick] [--device-ms T] [--rounds N] [--baseline DIR]
                                   [--pin] [--http [--stream-interval N]] [--structured FRACTION[,...]]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import checkout_path  # noqa: F401 - first: the checkout on sys.path, not tools/ (see there)
import numpy as np
import uvloop

from overhead_analysis import (  # noqa: E402
    CpuSample, cpu_ms_per_step, delivery_ms, median_of, step_stats, steady_window,
)
from pipeline.client import AsyncClient, Client  # noqa: E402
from pipeline.errors import DaemonNotRunning, PipelineError  # noqa: E402
from stages.contracts.params import SamplingParams  # noqa: E402
from stages.gpu_runner.simulated.steps import SimulatedTokens, read_timeline  # noqa: E402

BATCHES = (1, 64, 256)
PROMPT_TOKENS = 32
BLOCK_SIZE = 16
VOCAB_SIZE = 1024  # the tiny model's
EOS_TOKEN_IDS = [1]
START_TIMEOUT_S = 300.0
CPU_SAMPLE_S = 0.05
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
SEED = 0
STRUCTURED_SCHEMA = json.dumps({"type": "array", "minItems": 1000, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99999},
                                     "name": {"type": "string", "maxLength": 16},
                                     "kind": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"}},
    "required": ["id", "name", "kind", "ok"], "additionalProperties": False}})


@dataclass(slots=True)
class Daemon:
    label: str  # "async", "sync", "baseline async", ...
    async_scheduling: bool
    process: subprocess.Popen
    socket_path: Path
    trace_path: Path
    pids: dict[str, int]  # process name -> pid: the daemon and each stage
    http_url: str | None = None  # its OpenAI API, once it serves (started with `http`)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=60)


def engine_options(model: str, device_ms: float, max_model_len: int, async_scheduling: bool,
                   trace_path: str | None) -> dict:
    """The EngineConfig of a daemon on the simulated device, as keyword arguments."""
    return dict(model=model, device="cpu", max_num_seqs=max(BATCHES), max_model_len=max_model_len,
                num_kv_blocks=max(BATCHES) * -(-max_model_len // BLOCK_SIZE), block_size=BLOCK_SIZE,
                async_scheduling=async_scheduling, simulated_device_ms=device_ms, simulated_device_trace=trace_path)


# The daemon of the checkout in argv[1] on socket argv[2], EngineConfig(**argv[3]) and
# DaemonConfig(**argv[4]) given as JSON: any checkout of this repository serves this way, with
# or without HTTP, whatever its own copy of this script can do.
SERVE_CODE = """import json, logging, sys
sys.path.insert(0, sys.argv[1])
from pipeline.serve.config import DaemonConfig
from pipeline.serve.daemon import run_daemon
from stages.contracts.config import EngineConfig
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
sys.exit(run_daemon(EngineConfig(**json.loads(sys.argv[3])), sys.argv[2], settings=DaemonConfig(**json.loads(sys.argv[4]))))
"""


def make_model(directory: Path) -> Path:
    """The tiny llama checkpoint, made by another process: torch never enters this one, whose
    clients are measured (torch's objects would make each full garbage collection here a
    100 ms pause in the middle of a stream)."""
    run = subprocess.run([sys.executable, str(checkout_path.TOOLS / "make_tiny_model.py"), str(directory), "--arch",
                          "llama", "--seed", str(SEED)], capture_output=True, text=True, check=True)
    return Path(run.stdout.strip())


def daemon_command(checkout: Path, socket_path: Path | str, engine: dict, http_port: int | None,
                   stream_interval: int = 1) -> list[str]:
    """The command line of `checkout`'s daemon on `socket_path` (SERVE_CODE)."""
    settings = {"http_port": http_port} | ({"stream_interval": stream_interval} if stream_interval != 1 else {})
    return [sys.executable, "-c", SERVE_CODE, str(checkout), str(socket_path), json.dumps(engine),
            json.dumps(settings)]


def serve(args: argparse.Namespace) -> int:
    """The daemon on the simulated device, in place of this process, until SIGTERM or Ctrl-C."""
    from pipeline.models.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    engine = engine_options(model, args.device_ms, args.max_model_len, not args.no_async_scheduling, args.trace)
    os.execv(sys.executable, daemon_command(checkout_path.ROOT, args.serve, engine, args.http_port))


def start_daemon(label: str, checkout: Path, model: Path, directory: Path, device_ms: float, max_model_len: int,
                 async_scheduling: bool, http: bool, stream_interval: int = 1) -> Daemon:
    """Starts the daemon of `checkout` (with the HTTP API on a free port when `http`); returns
    before it answers (see wait_serving)."""
    directory.mkdir(mode=0o700)
    socket_path, trace_path = directory / "pipeline.sock", directory / "timeline.npy"
    engine = engine_options(str(model), device_ms, max_model_len, async_scheduling, str(trace_path))
    log = open(directory / "daemon.log", "wb")  # noqa: SIM115 - lives as long as the daemon
    command = daemon_command(checkout, socket_path, engine, 0 if http else None, stream_interval)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=checkout)
    return Daemon(label, async_scheduling, process, socket_path, trace_path, {"daemon": process.pid})


def wait_serving(daemon: Daemon) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if daemon.process.poll() is not None:
            log = (daemon.socket_path.parent / "daemon.log").read_text()
            raise RuntimeError(f"the {daemon.label} daemon exited with {daemon.process.returncode}:\n{log}")
        try:
            with Client(daemon.socket_path, timeout_s=5) as client:
                health = client.health()
            if health.status == "ok":
                daemon.pids.update(health.stage_pids)
                daemon.http_url = health.http_url
                return
        except (DaemonNotRunning, OSError, PipelineError):
            pass
        time.sleep(0.1)  # start-up poll: the stages take seconds to come up
    raise RuntimeError(f"the {daemon.label} daemon did not serve within {START_TIMEOUT_S} s")


CRITICAL_PATH_PROCESSES = ("scheduler", "runner")


def pin_processes(daemons: list[Daemon]) -> None:
    """--pin: every thread of the critical path's processes (scheduler, runner) on the first CPU
    this process may use, every thread of the daemons' other processes and of this one (the
    clients) on the second."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit(f"--pin needs two CPUs, this process may use {cpus}")
    first, rest = {cpus[0]}, {cpus[1]}
    pids = [(os.getpid(), rest)] + [(pid, first if name in CRITICAL_PATH_PROCESSES else rest)
                                    for daemon in daemons for name, pid in daemon.pids.items()]
    for pid, cores in pids:
        for thread_id in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(thread_id), cores)


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


async def sample_cpu(daemon: Daemon, samples: list[CpuSample]) -> None:
    """Every CPU_SAMPLE_S, the CPU time of the daemon's processes and this one (the clients)."""
    pids = dict(daemon.pids, client=os.getpid())
    while True:
        samples.append(CpuSample(time.monotonic_ns(), {name: cpu_seconds(pid) for name, pid in pids.items()}))
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


def measure(daemon: Daemon, batch: int, num_steps: int, device_ms: float, rng: np.random.Generator,
            multiplex: bool, structured: float = 0.0, http: bool = False) -> dict:
    """One batch on one daemon, round(structured x batch) of its requests constrained (or every
    request streamed over HTTP): the steady window's numbers."""
    prompts = [rng.integers(2, VOCAB_SIZE, PROMPT_TOKENS).tolist() for _ in range(batch)]
    num_constrained = round(structured * batch)
    since_ns = time.monotonic_ns()
    if http:
        samples = uvloop.run(stream_http(daemon, prompts, num_steps))
        tokens = None
    else:
        times, tokens, requests, samples = uvloop.run(stream_batch(daemon, prompts, num_steps, multiplex,
                                                                   num_constrained))
        if len(tokens) != batch * num_steps:
            raise RuntimeError(f"{daemon.label} batch {batch}: got {len(tokens)} tokens, expected {batch * num_steps}")
    warmup = max(10, num_steps // 8)
    window = steady_window(read_timeline(daemon.trace_path), since_ns, batch, warmup, cooldown=5)
    result = step_stats(window, device_ms, 2 if daemon.async_scheduling else 1)
    result["cpu_ms_per_step"] = cpu_ms_per_step(window, samples)
    result["cpu_us_per_token"] = cpu_us_per_token(result["cpu_ms_per_step"], batch)
    result["window_steps"] = window.num_steps
    if tokens is None:  # SSE frames do not name their tokens
        result["deliver_p50_ms"] = result["deliver_p99_ms"] = None
        return result
    free = requests >= num_constrained
    delivered = np.concatenate([
        delivery_ms(window, SimulatedTokens(VOCAB_SIZE, EOS_TOKEN_IDS), times[free], tokens[free]),
        delivery_by_order_ms(window, times[~free], requests[~free])])
    result["deliver_p50_ms"] = float(np.percentile(delivered, 50))
    result["deliver_p99_ms"] = float(np.percentile(delivered, 99))
    return result


def delivery_by_order_ms(window, received_ns: np.ndarray, requests: np.ndarray) -> np.ndarray:
    """Per token of a window step, receive time - its step's ready time (ms), for tokens that do not
    name their step: a request's k-th token was sampled k steps after its first, and its first
    step is the latest one with every token of the request received after its step was ready."""
    steps, ready = window.timeline["step"], window.timeline["ready_ns"]
    delivered = []
    for request in np.unique(requests):
        times = received_ns[requests == request]  # in arrival order, which is output order
        latest = steps[np.maximum(np.searchsorted(ready, times, side="right") - 1, 0)]
        step = (latest - np.arange(len(times))).min() + np.arange(len(times))
        inside = (step >= steps[window.first]) & (step <= steps[window.last])
        delivered.append((times[inside] - ready[step[inside] - steps[0]]) / 1e6)
    return np.concatenate(delivered) if delivered else np.zeros(0)


def grammar_mask_us() -> dict:
    """llguidance's per-token mask time on the tiny vocabulary (tools/bench_grammar.py --quick)."""
    run = subprocess.run([sys.executable, str(checkout_path.TOOLS / "bench_grammar.py"), "--quick", "--json",
                          "--library", "llguidance"], capture_output=True, text=True, check=True)
    tiny = json.loads(run.stdout)["llguidance"]["tiny_1024"]
    return {"p50": tiny["mask_us_p50"], "p99": tiny["mask_us_p99"]}


def run(args: argparse.Namespace) -> dict:
    num_steps = 240 if args.quick else 600
    max_model_len = PROMPT_TOKENS + num_steps + BLOCK_SIZE
    checkouts = [("", checkout_path.ROOT)] + ([("baseline ", Path(args.baseline).resolve())] if args.baseline else [])
    rng = np.random.default_rng(SEED)
    with tempfile.TemporaryDirectory(prefix="pl-overhead-") as directory:
        model = make_model(Path(directory) / "model")
        daemons = []
        try:
            for index, (prefix, checkout) in enumerate(checkouts):
                for mode, async_scheduling in (("async", True), ("sync", False)):
                    daemons.append(start_daemon(prefix + mode, checkout, model, Path(directory) / f"d{len(daemons)}",
                                                args.device_ms, max_model_len, async_scheduling, args.http,
                                                1 if prefix else args.stream_interval))
            for daemon in daemons:
                wait_serving(daemon)
            if args.pin:
                pin_processes(daemons)
            cases = [(batch, fraction) for fraction in (args.structured or [None]) for batch in args.batches]
            runs: dict[str, dict[str, list[dict]]] = {d.label: {case_key(*c): [] for c in cases} for d in daemons}
            for _ in range(args.rounds):
                for batch, fraction in cases:
                    for daemon in daemons:
                        multiplex = args.multiplex and (args.baseline_multiplex or not daemon.label.startswith("baseline "))
                        runs[daemon.label][case_key(batch, fraction)].append(measure(
                            daemon, batch, num_steps, args.device_ms, rng, multiplex, fraction or 0.0, args.http))
        finally:
            for daemon in daemons:
                daemon.stop()
    results: dict[str, object] = {"device_ms": args.device_ms, "multiplex": args.multiplex, "pin": args.pin,
                                  "http": args.http, "stream_interval": args.stream_interval}
    for label, by_batch in runs.items():
        target = results.setdefault("baseline", {"checkout": args.baseline}) if label.startswith("baseline ") else results
        target[label.split()[-1]] = {key: median_of(batch_runs) for key, batch_runs in by_batch.items()}
    if args.structured:
        results["grammar_mask_us"] = grammar_mask_us()
    results["conditions"] = {"rounds": args.rounds, "steps_per_request": num_steps, "cpu_count": os.cpu_count(),
                             "loadavg_1m_at_end": os.getloadavg()[0]}
    return results


def case_key(batch: int, fraction: float | None) -> str:
    """A result's key: the batch, and with --structured the constrained fraction ("64 s0.5")."""
    return str(batch) if fraction is None else f"{batch} s{fraction:g}"


def print_report(results: dict) -> None:
    device_ms = results["device_ms"]
    conditions = results["conditions"]
    print(f"simulated device step T = {device_ms} ms; {conditions['rounds']} round(s) of each batch, "
          f"{conditions['steps_per_request']} output tokens per request; {conditions['cpu_count']} CPUs, "
          f"load average {conditions['loadavg_1m_at_end']:.1f} at the end")
    print("step: mean wall ms per step; exposed: % of T the device sat idle; deliver: ready on device -> client (ms);")
    print("loop: tokens ready -> launch of the step planned from them (ms, async may use up to T); CPU ms per step")
    table = [("", results)] + ([("baseline ", results["baseline"])] if "baseline" in results else [])
    names = list(next(iter(results["async"].values()))["cpu_ms_per_step"])
    if "grammar_mask_us" in results:
        mask = results["grammar_mask_us"]
        print(f"batch 'B sF': F of the B rows constrained by a JSON schema; llguidance mask per token "
              f"p50 {mask['p50']} us, p99 {mask['p99']} us (tiny vocabulary)")
    print(f"{'daemon':<15}{'batch':>9}{'step':>8}{'exposed':>9}{'deliver p50/p99':>17}{'loop p50/p99':>14}  "
          + " ".join(f"{n[:9]:>9}" for n in names))
    for prefix, source in table:
        for mode in ("async", "sync"):
            for batch, r in source[mode].items():
                cpu = r["cpu_ms_per_step"]
                deliver = ("-" if r["deliver_p50_ms"] is None
                           else f"{r['deliver_p50_ms']:.2f}/{r['deliver_p99_ms']:.2f}")
                print(f"{prefix + mode:<15}{batch:>9}{r['step_ms']:>8.3f}{r['exposed_pct']:>8.1f}%{deliver:>17}"
                      f"{r['loop_p50_ms']:>6.2f}/{r['loop_p99_ms']:<7.2f} "
                      + " ".join(f"{cpu[n]:>9.3f}" for n in names))


def print_budget(results: dict) -> None:
    """Per step at the largest batch, async: the host's critical path against T, and each
    process's CPU time against what the machine's CPUs offer in T."""
    device_ms, cpus = results["device_ms"], results["conditions"]["cpu_count"]
    batch, r = max(results["async"].items(), key=lambda item: int(item[0].split()[0]))
    cpu = r["cpu_ms_per_step"]
    print(f"\nhost budget per step at batch {batch}, async, T = {device_ms} ms:")
    print(f"  critical path (tokens ready -> launch of the step planned from them): p50 {r['loop_p50_ms']:.2f} ms, "
          f"p99 {r['loop_p99_ms']:.2f} ms; headroom under T at p50 {device_ms - r['loop_p50_ms']:.2f} ms")
    print("  CPU ms per step: " + ", ".join(f"{name} {value:.2f}" for name, value in cpu.items())
          + f"; all {sum(cpu.values()):.2f} of the {cpus * device_ms:.1f} that {cpus} CPUs offer per step")
    for prefix, source in [("", results)] + ([("baseline ", results["baseline"])] if "baseline" in results else []):
        per_token = cpu_us_per_token(source["async"][batch]["cpu_ms_per_step"], int(batch.split()[0]))
        print(f"  {prefix}CPU us per generated token: " + ", ".join(f"{n} {v:.2f}" for n, v in per_token.items()))


def cpu_us_per_token(cpu_ms_per_step: dict[str, float], batch: int) -> dict[str, float]:
    """Each process's CPU time per generated token, µs (every row samples one token a step).
    `client` is this process: all the batch's streaming socket clients together."""
    return {name: 1e3 * ms / batch for name, ms in cpu_ms_per_step.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="one round of shorter outputs (about a minute)")
    parser.add_argument("--device-ms", type=float, default=5.0, help="the simulated device's step time T")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every batch (default 3, --quick 1)")
    parser.add_argument("--batches", type=lambda text: [int(b) for b in text.split(",")], default=list(BATCHES))
    parser.add_argument("--baseline", help="another checkout whose daemons are measured in the same rounds")
    parser.add_argument("--multiplex", action="store_true",
                        help="this checkout's clients share one connection per batch (the baseline's keep one each)")
    parser.add_argument("--baseline-multiplex", action="store_true",
                        help="with --multiplex: the baseline's clients share a connection too (a baseline that has it)")
    parser.add_argument("--pin", action="store_true",
                        help="scheduler and runner on one CPU, every other process (clients too) on another")
    parser.add_argument("--structured", type=lambda text: [float(f) for f in text.split(",")], default=None,
                        metavar="FRACTION[,FRACTION...]",
                        help="measure each batch with these fractions of its requests constrained by a JSON schema")
    parser.add_argument("--http", action="store_true",
                        help="stream every request as Server-Sent Events from the OpenAI API, a connection each")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="with --http: this checkout's daemons send a stream's text every N tokens "
                             "(`pipeline start --stream-interval`; the baseline's send every token)")
    parser.add_argument("--serve", metavar="SOCKET", help="only serve on the simulated device, until Ctrl-C")
    parser.add_argument("--http-port", type=int, default=None, help="with --serve: serve the HTTP API on this port")
    parser.add_argument("--model", help="with --serve: checkpoint directory (default: the embedded tiny model)")
    parser.add_argument("--max-model-len", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--no-async-scheduling", action="store_true", help="with --serve")
    args = parser.parse_args(argv)
    if args.serve:
        return serve(args)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if max(args.batches) > max(BATCHES) or min(args.batches) < 1:
        parser.error(f"--batches must be in [1, {max(BATCHES)}], got {args.batches}")
    if args.stream_interval < 1 or (args.stream_interval > 1 and not args.http):
        parser.error(f"--stream-interval must be a positive integer, and above 1 only with --http, "
                     f"got {args.stream_interval}")
    if args.http and (args.multiplex or args.structured is not None):
        parser.error("--http streams each request on its own HTTP connection: no --multiplex or --structured")
    if args.structured is not None and not all(0.0 <= f <= 1.0 for f in args.structured):
        parser.error(f"--structured fractions must be in [0, 1], got {args.structured}")
    # SIGTERM unwinds like Ctrl-C, so the daemons this starts are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results = run(args)
    if args.json:
        print(json.dumps(results))
    else:
        print_report(results)
        print_budget(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
