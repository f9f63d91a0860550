"""What tools/bench/bench_overhead.py computes from one run of a batch: the steady window of the simulated
device's timeline, step time, device idle, delivery latency and CPU time per step.

Inputs are plain arrays: the timeline the simulated device wrote (stages/gpu_runner/simulated/device.py),
the (receive time, token id) of every token the clients got, and the CPU-time samples of every
process. Times are CLOCK_MONOTONIC ns, the clock of every process on the machine.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stages.gpu_runner.simulated.steps import SimulatedTokens


@dataclass(slots=True)
class CpuSample:
    time_ns: int
    cpu_s: dict[str, float]  # process name -> utime + stime so far


@dataclass(slots=True)
class Window:
    """Steps first..last (inclusive) of a timeline, all sampling the whole batch."""

    timeline: dict[str, np.ndarray]  # the run's steps, consecutive, in step order
    first: int  # index into the timeline arrays
    last: int

    @property
    def num_steps(self) -> int:
        return self.last - self.first + 1

    def column(self, name: str) -> np.ndarray:
        return self.timeline[name][self.first:self.last + 1]


def steady_window(timeline: dict[str, np.ndarray], since_ns: int, batch: int, warmup: int, cooldown: int) -> Window:
    """The steps planned after `since_ns` that sampled all `batch` rows (the longest run of them),
    less `warmup` at the start and `cooldown` at the end. ValueError if nothing is left."""
    keep = timeline["plan_ns"] >= since_ns
    run = {name: values[keep] for name, values in timeline.items()}
    if len(run["step"]) and np.any(np.diff(run["step"]) != 1):
        raise ValueError("the timeline misses steps of this run: it wrapped, or two runs overlapped")
    full = np.flatnonzero(run["num_sampled"] == batch)
    if not len(full):
        raise ValueError(f"no step sampled all {batch} rows")
    breaks = np.flatnonzero(np.diff(full) != 1)
    starts = np.concatenate(([0], breaks + 1))
    ends = np.concatenate((breaks, [len(full) - 1]))
    longest = int(np.argmax(ends - starts))
    first, last = int(full[starts[longest]]) + warmup, int(full[ends[longest]]) - cooldown
    if last - first < 2:
        raise ValueError(f"{int(ends[longest] - starts[longest]) + 1} steps sampled all {batch} rows: "
                         f"too few for a warmup of {warmup} and a cooldown of {cooldown}")
    return Window(run, first, last)


def step_stats(window: Window, device_ms: float, steps_in_flight: int) -> dict[str, float]:
    """step_ms: mean wall time per step; exposed_pct: the share of T the device sat idle;
    loop_ms: from a step's tokens being ready to the launch of the step planned from them
    (async plans step N+2 from step N's tokens, sync step N+1), the host's critical path."""
    ready = window.column("ready_ns")
    step_ms = float(ready[-1] - ready[0]) / (window.num_steps - 1) / 1e6
    all_ready, all_launch = window.timeline["ready_ns"], window.timeline["launch_ns"]
    first = max(window.first, steps_in_flight)
    loop_ms = (all_launch[first:window.last + 1] - all_ready[first - steps_in_flight:window.last + 1 - steps_in_flight]) / 1e6
    idle_ms = (window.column("start_ns")[1:] - ready[:-1]) / 1e6
    return {"step_ms": step_ms, "exposed_pct": 100.0 * (step_ms - device_ms) / device_ms,
            "idle_steps_pct": 100.0 * float(np.mean(idle_ms > 0)),
            "loop_p50_ms": float(np.percentile(loop_ms, 50)), "loop_p99_ms": float(np.percentile(loop_ms, 99)),
            "runner_prep_ms": float(np.median(window.column("launch_ns") - window.column("plan_ns")) / 1e6)}


def delivery_ms(window: Window, tokens: SimulatedTokens, received_ns: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """Per token of a window step the clients received: receive time - the step's ready time, ms.

    A token names its step modulo `tokens.period`; of those steps it came from the latest one
    ready by the time it arrived (a step's tokens are never readable before they are ready)."""
    steps, ready = window.timeline["step"], window.timeline["ready_ns"]
    residue = np.array([tokens.step_residue(t) for t in token_ids.tolist()], np.int64)
    latest = np.searchsorted(ready, received_ns, side="right") - 1
    known = latest >= 0
    latest_step = steps[np.maximum(latest, 0)]
    step = latest_step - (latest_step - residue) % tokens.period
    in_window = known & (step >= steps[window.first]) & (step <= steps[window.last])
    index = step[in_window] - steps[0]
    return (received_ns[in_window] - ready[index]) / 1e6


def cpu_ms_per_step(window: Window, samples: list[CpuSample]) -> dict[str, float]:
    """CPU ms each process spent per step, between the first and last CPU sample inside the window."""
    start, end = int(window.column("ready_ns")[0]), int(window.column("ready_ns")[-1])
    inside = [s for s in samples if start <= s.time_ns <= end]
    if len(inside) < 2:
        raise ValueError(f"{len(inside)} CPU samples fell in the window: it is shorter than two sample periods")
    a, b = inside[0], inside[-1]
    ready = window.column("ready_ns")
    num_steps = int(np.count_nonzero((ready > a.time_ns) & (ready <= b.time_ns)))
    return {name: 1e3 * (b.cpu_s[name] - a.cpu_s[name]) / num_steps for name in a.cpu_s}


def median_of(runs: list[dict[str, object]]) -> dict[str, object]:
    """Key by key, the median over runs (of each entry, for a dict of numbers); None stays None
    (a figure not measured)."""
    merged: dict[str, object] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            merged[key] = {name: float(np.median([run[key][name] for run in runs])) for name in value}
        elif value is None:
            merged[key] = None
        else:
            merged[key] = float(np.median([run[key] for run in runs]))
    return merged
