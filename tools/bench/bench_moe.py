"""The fused MoE layer against a loop over every expert and against transformers' own MoE block, side
by side in one run, on CPU, with each batch's active-parameter floor.

Usage: python tools/bench/bench_moe.py [--batches 1 32 256] [--layers 4] [--experts 64] [--top-k 8]
                                       [--hidden 512] [--moe-intermediate 256] [--threads N] [--json]

The model is shaped like Qwen3-30B-A3B scaled to a small machine (64 experts, top-8, renormalised,
hidden 512, experts of 256): `--layers` MoE blocks, each with its own random weights, so a step
reads its experts from memory as a real model's does. Each batch of tokens runs through every
layer with:
- fused: layers/fused_moe (tokens grouped by expert, one matmul pair per active expert);
- loop: a Python loop over all experts, each finding its tokens by a mask (inactive ones too);
- hf: transformers' Qwen3MoeSparseMoeBlock forward on the same weights (its eager experts).
The floor is the least time a step can take: the longer of the bytes of the weights it must read
(router plus the experts its tokens chose, counted per layer) over the memory bandwidth measured
by a large copy, and its FLOPs (2 per multiply-add of the chosen experts) over the rate of a large
float32 matmul; floor tokens/s is the batch over that time, and the table says which bound it is.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stages.gpu_runner.layers.fused_moe.experts import fused_experts
from stages.gpu_runner.layers.fused_moe.routing import TopK, select_experts


def memory_bandwidth_gb_s(num_bytes: int = 256 << 20) -> float:
    """Bytes read plus written per second by a large copy, the median of 5."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times[1:]) / 1e9


def matmul_gflop_s(n: int = 1024) -> float:
    """float32 GFLOP/s of an n x n x n matmul, the median of 5."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n ** 3 / statistics.median(times[1:]) / 1e9


def loop_over_all_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                          ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        token, choice = torch.where(ids == expert)
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[token, choice, None]
        out.index_add_(0, token, y)
    return out


class Layers:
    """`num_layers` MoE layers of random weights, and transformers' block on each layer's same tensors."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        gen = torch.Generator().manual_seed(0)
        e, h, i = args.experts, args.hidden, args.moe_intermediate
        config = Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=args.top_k, moe_intermediate_size=i,
                                norm_topk_prob=True)
        self.top = TopK(args.top_k, renormalize=True, weights_float32=False)
        self.weights, self.hf = [], []
        for _ in range(args.layers):
            router = torch.randn(e, h, generator=gen) * 0.05
            w13 = torch.randn(e, 2 * i, h, generator=gen) * 0.05
            w2 = torch.randn(e, h, i, generator=gen) * 0.05
            self.weights.append((router, w13, w2))
            block = Qwen3MoeSparseMoeBlock(config).eval()
            block.gate.weight.data = router  # shared storage: one copy of the weights in memory
            block.experts.gate_up_proj.data = w13
            block.experts.down_proj.data = w2
            self.hf.append(block)

    def run(self, method: str, x: torch.Tensor) -> torch.Tensor:
        for (router, w13, w2), block in zip(self.weights, self.hf):
            if method == "hf":
                x = block(x.unsqueeze(0))[0]
                continue
            weights, ids = select_experts(F.linear(x, router), self.top)
            x = (fused_experts if method == "fused" else loop_over_all_experts)(x, w13, w2, weights, ids)
        return x

    def active_bytes(self, x: torch.Tensor) -> int:
        """Weight bytes a step over `x` must read: each layer's router and the experts its tokens chose."""
        total = 0
        for router, w13, w2 in self.weights:
            weights, ids = select_experts(F.linear(x, router), self.top)
            per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
            total += router.numel() * router.element_size() + len(ids.unique()) * per_expert
            x = fused_experts(x, w13, w2, weights, ids)
        return total


def seconds_per_step(step: Callable[[], object], min_s: float = 0.3, min_reps: int = 3) -> float:
    step()  # warm-up
    times: list[float] = []
    while len(times) < min_reps or sum(times) < min_s:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = Layers(args)
    bandwidth, gflop_s = memory_bandwidth_gb_s(), matmul_gflop_s()
    flops_per_token = args.layers * args.top_k * 3 * args.hidden * args.moe_intermediate * 2
    rows = []
    with torch.no_grad():
        for batch in args.batches:
            x = torch.randn(batch, args.hidden, generator=torch.Generator().manual_seed(batch))
            want = layers.run("hf", x)
            for method in ("fused", "loop"):
                if not torch.allclose(layers.run(method, x), want, rtol=1e-4, atol=1e-5):
                    raise SystemExit(f"{method} differs from transformers at batch {batch}")
            tokens_s = {m: batch / seconds_per_step(lambda m=m: layers.run(m, x)) for m in ("fused", "loop", "hf")}
            active = layers.active_bytes(x)
            memory_s, compute_s = active / (bandwidth * 1e9), batch * flops_per_token / (gflop_s * 1e9)
            floor = batch / max(memory_s, compute_s)
            rows.append(dict(batch=batch, **{f"{m}_tokens_s": v for m, v in tokens_s.items()},
                             fused_over_loop=tokens_s["fused"] / tokens_s["loop"],
                             fused_over_hf=tokens_s["fused"] / tokens_s["hf"],
                             active_weight_mb=active / 1e6, floor_tokens_s=floor,
                             bound="memory" if memory_s >= compute_s else "compute",
                             fused_of_floor=tokens_s["fused"] / floor))
    result = dict(shape=dict(layers=args.layers, experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                             moe_intermediate=args.moe_intermediate, dtype="float32"),
                  threads=torch.get_num_threads(), bandwidth_gb_s=bandwidth, matmul_gflop_s=gflop_s, rows=rows)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.layers} MoE layers: {args.experts} experts, top-{args.top_k}, hidden {args.hidden}, experts of "
          f"{args.moe_intermediate}, float32; {torch.get_num_threads()} threads; copy bandwidth {bandwidth:.1f} GB/s, "
          f"matmul {gflop_s:.1f} GFLOP/s")
    print(f"{'batch':>5} {'fused tok/s':>11} {'loop tok/s':>10} {'hf tok/s':>9} {'fused/loop':>10} {'fused/hf':>8} "
          f"{'active MB':>9} {'floor tok/s':>11} {'bound':>7} {'of floor':>8}")
    for r in rows:
        print(f"{r['batch']:>5} {r['fused_tokens_s']:>11.0f} {r['loop_tokens_s']:>10.0f} {r['hf_tokens_s']:>9.0f} "
              f"{r['fused_over_loop']:>10.2f} {r['fused_over_hf']:>8.2f} {r['active_weight_mb']:>9.1f} "
              f"{r['floor_tokens_s']:>11.0f} {r['bound']:>7} {r['fused_of_floor']:>8.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
