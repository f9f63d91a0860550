"""Benchmark: does host work ever make the device wait? The real daemon on a simulated device, async vs sync.

The daemon and its stage processes are the real ones; only the model is replaced by a simulated
device (stages/gpu_runner/simulated/device.py) whose every step takes T ms of wall time and no CPU, so
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
requests are constrained by a JSON schema (overhead_streams.STRUCTURED_SCHEMA: a long array of
small objects, so no row finishes its grammar within the run); the runner does the real grammar
work per step on the simulated device (stages/gpu_runner/simulated/device.py), and the table adds the
grammar library's per-token mask time (tools/micro/bench_grammar.py). A constrained row's tokens
do not name their step: its k-th token came k steps after its first, which is placed at the latest step consistent with
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

    python tools/bench/bench_overhead.py [--json] [--quick] [--device-ms T] [--rounds N] [--baseline DIR]
                                   [--pin] [--http [--stream-interval N]] [--structured FRACTION[,...]]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import uvloop
from overhead_analysis import cpu_ms_per_step, delivery_ms, median_of, step_stats, steady_window
from overhead_daemons import (BATCHES, BLOCK_SIZE, SEED, TOOLS, Daemon, daemon_command, engine_options, make_model,
                              pin_processes, start_daemon, wait_serving)
from overhead_streams import stream_batch, stream_http

from pipeline.bench.daemon import CHECKOUT
from stages.gpu_runner.simulated.steps import SimulatedTokens, read_timeline

PROMPT_TOKENS = 32
VOCAB_SIZE = 1024  # the tiny model's
EOS_TOKEN_IDS = [1]


def serve(args: argparse.Namespace) -> int:
    """The daemon on the simulated device, in place of this process, until SIGTERM or Ctrl-C."""
    from pipeline.models.default_model import ensure_default_model

    model = args.model or str(ensure_default_model())
    engine = engine_options(model, args.device_ms, args.max_model_len, not args.no_async_scheduling, args.trace)
    os.execv(sys.executable, daemon_command(CHECKOUT, args.serve, engine, args.http_port))


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
    """llguidance's per-token mask time on the tiny vocabulary (tools/micro/bench_grammar.py --quick)."""
    run = subprocess.run([sys.executable, str(TOOLS / "micro" / "bench_grammar.py"), "--quick", "--json",
                          "--library", "llguidance"], capture_output=True, text=True, check=True)
    tiny = json.loads(run.stdout)["llguidance"]["tiny_1024"]
    return {"p50": tiny["mask_us_p50"], "p99": tiny["mask_us_p99"]}


def run(args: argparse.Namespace) -> dict:
    num_steps = 240 if args.quick else 600
    max_model_len = PROMPT_TOKENS + num_steps + BLOCK_SIZE
    checkouts = [("", CHECKOUT)] + ([("baseline ", Path(args.baseline).resolve())] if args.baseline else [])
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
