"""Cost of one stage phase range (`with ctx.range(name):`), measured side by side with no range.

Usage: python tools/micro/bench_stage_range.py [--iterations N] [--json]
Rows: the loop with no range; with an empty context manager (the floor of any `with`); with a
phase range and no NVTX tool attached (how a daemon started without `--nsys` runs); the same
while a torch.profiler capture runs in the process (what the tools/profiling/profile_daemon.py fallback costs).
Each is the best of --repeats runs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory

from stages.profiling import StageProfiler


class _Empty:
    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None


def best_ns_per_iteration(body: Callable[[int], None], iterations: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        body(iterations)
        best = min(best, (time.perf_counter_ns() - start) / iterations)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=1_000_000)
    parser.add_argument("--capture-iterations", type=int, default=20_000,
                        help="iterations while torch.profiler captures (each records an event)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)

    profiler = StageProfiler("bench")
    phase = profiler.range("step")

    def no_range(n: int) -> None:
        for _ in range(n):
            pass

    def with_range(n: int) -> None:
        for _ in range(n):
            with phase:
                pass

    empty = _Empty()

    def with_empty(n: int) -> None:
        for _ in range(n):
            with empty:
                pass

    base_ns = best_ns_per_iteration(no_range, args.iterations, args.repeats)
    empty_ns = best_ns_per_iteration(with_empty, args.iterations, args.repeats)
    range_ns = best_ns_per_iteration(with_range, args.iterations, args.repeats)
    with TemporaryDirectory() as directory:
        profiler.start(Path(directory))
        capture_ns = best_ns_per_iteration(with_range, args.capture_iterations, args.repeats)
        profiler.discard()
    result = {
        "nvtx_tool_attached": profiler.nvtx_attached,
        "no_range_ns": base_ns,
        "empty_with_ns": empty_ns,
        "range_ns": range_ns,
        "range_overhead_ns": range_ns - base_ns,
        "range_capturing_ns": capture_ns,
        "range_capturing_overhead_ns": capture_ns - base_ns,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'loop body':<46} {'ns/iteration':>12} {'overhead ns':>12}")
    print(f"{'no range':<46} {base_ns:>12.1f} {'':>12}")
    print(f"{'empty context manager':<46} {empty_ns:>12.1f} {empty_ns - base_ns:>12.1f}")
    tool = "an NVTX tool attached" if result["nvtx_tool_attached"] else "no NVTX tool attached"
    print(f"{'phase range, ' + tool:<46} {range_ns:>12.1f} {range_ns - base_ns:>12.1f}")
    print(f"{'phase range, torch.profiler capturing':<46} {capture_ns:>12.1f} {capture_ns - base_ns:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
