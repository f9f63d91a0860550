"""GGUF block-quantized matmul against the dense float32 matmul, on the real models' shapes.

For each weight shape and block type of SmolLM2-135M (Q4_1 projections, Q8_0 tied head) and
Gemma-3-270M Q4_K_M (Q5_0, Q4_K, Q6_K projections, Q8_0 head), and each number of activation rows,
times in one run:
  - dense: torch's float32 `x @ w.T` on a dense weight of the same shape;
  - fused: cpu_ops/quant.c's fused dequantize-and-dot (decode batches);
  - tiled: cpu_ops/quant_gemm.c (tiles decoded into an L2-sized buffer, register-blocked multiply);
  - method: what layers/quantization/gguf.py picks for that many rows;
  - x8: cpu_ops/quant_x8.c, 8-bit activations (--quantized-activations int8), where the CPU has
    it, up to X8_ROWS rows (what the method then picks);
the best of --repeat calls each (milliseconds), the method's ratio to dense, and the sum over one
model step (every layer's projections and the head). Random blocks: the kernels' speed does not
depend on the values. As in a model step, weights come from memory, not a warm cache: each call
takes the next of enough copies of the weight (dense and blocks) to fill COLD_BYTES, several times
the last-level cache. Threads: torch's (set OMP_NUM_THREADS to change both). On a shared machine only
ratios from one run count; the load average is printed. With OMP_NUM_THREADS=1 the times are the
thread's CPU time, which preemption by other processes does not inflate.

    python tools/micro/bench_quant_matmul.py [--rows 1 8 32 128 512] [--model smollm2 gemma3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QType

from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.layers.quantization.gguf import X8_ROWS, GGUFMethod

# (block type, rows, cols, how many such weights one forward step multiplies), as the model holds
# them: q/k/v and gate/up merged into one weight where the file stores them in one block type.
SHAPES = {
    "smollm2": [(QType.Q4_1, 3072, 576, 30), (QType.Q4_1, 576, 1536, 30), (QType.Q4_1, 960, 576, 30),
                (QType.Q4_1, 576, 576, 30), (QType.Q8_0, 49152, 576, 1)],
    "gemma3": [(QType.Q5_0, 4096, 640, 18), (QType.Q6_K, 640, 2048, 9), (QType.Q4_K, 640, 2048, 9),
               (QType.Q5_0, 1536, 640, 9), (QType.Q5_0, 1024, 640, 9), (QType.Q5_0, 256, 640, 9),
               (QType.Q8_0, 256, 640, 9), (QType.Q4_K, 640, 1024, 18), (QType.Q8_0, 262144, 640, 1)],
}


def random_blocks(qtype: QType, rows: int, cols: int) -> torch.Tensor:
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    blocks[:, :2] = np.full((blocks.shape[0], 1), 0.01, np.float16).view(np.uint8)  # a finite scale
    return torch.from_numpy(blocks).reshape(rows, -1).contiguous()


COLD_BYTES = 128 << 20


def copies(tensor: torch.Tensor, dense_bytes: int) -> list[torch.Tensor]:
    return [tensor.clone() for _ in range(max(1, COLD_BYTES // dense_bytes))]


def rotating(call, *pools: list[torch.Tensor]):
    """call(*one copy from each pool), taking the next copies each time."""
    state = {"at": 0}

    def next_call():
        state["at"] = (state["at"] + 1) % len(pools[0])
        return call(*(pool[state["at"]] for pool in pools))
    return next_call


def best_ms(call, repeat: int) -> float:
    """The best of `repeat` calls after a warm-up. With one thread, the calling thread's CPU time
    (every kernel here runs in it then): on a loaded machine, time spent preempted is not counted."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    call()
    best = float("inf")
    for _ in range(repeat):
        start = clock()
        call()
        best = min(best, clock() - start)
    return best * 1e3


def measure(model: str, row_counts: list[int], repeat: int) -> list[dict]:
    method, results = GGUFMethod(), []
    for qtype, rows, cols, per_step in SHAPES[model]:
        dense_bytes = rows * cols * 4
        blocks = copies(random_blocks(qtype, rows, cols), dense_bytes)
        weights = [QuantizedWeight(qtype.value, one, (rows, cols)) for one in blocks]
        dense = copies(torch.randn(rows, cols), dense_bytes)
        big = rows * cols > 50_000_000  # the Gemma head: fewer calls
        for n in row_counts:
            x = torch.randn(n, cols)
            times = max(2, repeat // (4 if big else 1))
            row = {"model": model, "qtype": qtype.name, "rows": rows, "cols": cols, "per_step": per_step, "n": n,
                   "dense_ms": best_ms(rotating(lambda w: x @ w.T, dense), times),
                   "fused_ms": best_ms(rotating(lambda b: quant.matmul(x, b, qtype, cols), blocks), times)
                   if n <= 64 else None,
                   "tiled_ms": best_ms(rotating(lambda b: quant.matmul_tiled(x, b, qtype, cols), blocks), times),
                   "method_ms": best_ms(rotating(lambda w: method.apply(w, x, None), weights), times),
                   "x8_ms": best_ms(rotating(lambda b: quant.matmul_x8(x, b, qtype, cols), blocks), times)
                   if n <= X8_ROWS and quant.x8_available(qtype) else None}
            row["ratio"] = row["method_ms"] / row["dense_ms"]
            results.append(row)
        del dense, blocks, weights
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    parser.add_argument("--model", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES, reverse=True))
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [row for model in args.model for row in measure(model, args.rows, args.repeat)]
    load = os.getloadavg()[0]
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "load": load, "results": results}, indent=1))
        return
    clock = "thread CPU time" if torch.get_num_threads() == 1 else "wall time"
    print(f"threads {torch.get_num_threads()}, load average {load:.2f}; best of {args.repeat} calls, ms of {clock}")
    print(f"{'model':8} {'type':5} {'shape':>12} {'rows':>5} {'dense':>8} {'fused':>8} {'tiled':>8} "
          f"{'method':>8} {'m/dense':>8} {'x8':>8}")
    for row in results:
        fused = "-" if row["fused_ms"] is None else f"{row['fused_ms']:.3f}"
        print(f"{row['model']:8} {row['qtype']:5} {row['rows']:>6}x{row['cols']:<5} {row['n']:>5} "
              f"{row['dense_ms']:>8.3f} {fused:>8} {row['tiled_ms']:>8.3f} {row['method_ms']:>8.3f} "
              f"{row['ratio']:>8.2f} {'-' if row['x8_ms'] is None else format(row['x8_ms'], '.3f'):>8}")
    print("one forward step (sum over its weights), ms:")
    for model in args.model:
        for n in args.rows:
            rows = [row for row in results if row["model"] == model and row["n"] == n]
            dense = sum(row["dense_ms"] * row["per_step"] for row in rows)
            method = sum(row["method_ms"] * row["per_step"] for row in rows)
            x8 = sum((row["method_ms"] if row["x8_ms"] is None else row["x8_ms"]) * row["per_step"] for row in rows)
            print(f"  {model:8} rows {n:>4}: dense {dense:9.2f}  quantized {method:9.2f}  ratio {method / dense:.2f}"
                  f"  int8 activations {x8:9.2f}")


if __name__ == "__main__":
    main()
