"""What tools/gpu/bench_gpu.py reads from torch.profiler's events of steady decode steps: how busy
the device was, how many kernels a step launches, and where the device waited."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LONG_GAP_US = 3.0  # an idle gap on the device longer than this waits for the host, not for a launch


def summarize_profile(events: Sequence[Any], wall_s: float, steps: int, device: str, batch: int) -> dict[str, Any]:
    """Busy share and kernels per step from profiler events. busy_share is the union of kernel and
    copy intervals over the span from the window's first device event to its last (the profiler's
    own start and stop leave the device idle at the window's edges; busy_share_wall counts those
    too). The idle time between them is split into short gaps (<= LONG_GAP_US: a kernel's launch
    after the one before, inside a graph) and long ones (the device waiting for the host), and the
    three longest waits are named by the work on either side. On CPU there are no kernels: the
    count is of aten ops, and there is no busy share."""
    result: dict[str, Any] = {"batch": batch, "steps": steps, "wall_ms_per_step": wall_s * 1e3 / steps}
    if device != "cuda":
        num_ops = sum(1 for e in events if e.name.startswith("aten::") and getattr(e, "cpu_parent", None) is None)
        return {**result, "busy_share": None, "kernels_per_step": None, "aten_ops_per_step": num_ops / steps,
                "note": "no CUDA device: the profiler sees no kernels; aten_ops_per_step counts top-level CPU ops"}
    from torch.autograd import DeviceType

    device_events = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels = [e for e in device_events if not e.name.lower().startswith(("memcpy", "memset"))]
    named = sorted((e.time_range.start, e.time_range.end, e.name) for e in device_events)
    busy_us, idle = 0.0, []
    current_start = current_end = None
    current_name = ""
    for start, end, name in named:  # the union, in case streams overlap; the idle gaps between
        if current_end is None or start > current_end:
            if current_end is not None:
                busy_us += current_end - current_start
                idle.append((start - current_end, current_name, name))
            current_start, current_end = start, end
        elif end > current_end:
            current_end = end
        if end >= current_end:
            current_name = name
    if current_end is not None:
        busy_us += current_end - current_start
    span_us = named[-1][1] - named[0][0] if named else 0.0
    # Where the device waited longest, summed by the work on each side of the wait.
    waits: dict[tuple[str, str], float] = {}
    for gap_us, before, after in idle:
        if gap_us > LONG_GAP_US:
            key = (before[:60], after[:60])
            waits[key] = waits.get(key, 0.0) + gap_us
    longest = sorted(waits.items(), key=lambda item: -item[1])[:3]
    return {**result, "busy_share": busy_us / span_us if span_us else None, "busy_share_wall": busy_us / 1e6 / wall_s,
            "kernels_per_step": len(kernels) / steps, "copies_per_step": (len(device_events) - len(kernels)) / steps,
            "device_ms_per_step": busy_us / 1e3 / steps,
            "short_gaps_ms_per_step": sum(g for g, _, _ in idle if g <= LONG_GAP_US) / 1e3 / steps,
            "long_gaps_ms_per_step": sum(g for g, _, _ in idle if g > LONG_GAP_US) / 1e3 / steps,
            "longest_waits": [{"after": a, "before": b, "ms_per_step": us / 1e3 / steps} for (a, b), us in longest]}
