"""The decode-graph layer: one CUDA graph per batch-size bucket, captured at start and replayed.

`forward(num_rows, max_context)` is the decode step over the static buffers (static_decode.py):
it reads nothing but those buffers and the model's tensors, and returns its output tensors. When
capturing, each bucket's call is recorded once into a graph (all graphs share one memory pool)
and its outputs are kept: a replay refills exactly those tensors. Without capture (CPU, the torch
backend, enforce_eager) the same call runs eagerly each step, so the CPU exercises the same path.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from stages.progress import Progress

DecodeForward = Callable[[int, int], tuple[torch.Tensor, ...]]


class DecodeGraphs:
    def __init__(self, forward: DecodeForward, buckets: list[int], device: torch.device, *, capture: bool) -> None:
        self.forward = forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        if capture:
            if device.type != "cuda":
                raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
            self._capture(buckets, device)

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    @torch.inference_mode()
    def _capture(self, buckets: list[int], device: torch.device) -> None:
        pool = torch.cuda.graph_pool_handle()
        progress = Progress("warming up: capturing the decode steps' CUDA graphs", total=len(buckets)).start()
        # Largest first: the smaller graphs then fit in the memory the largest left in the pool.
        for bucket in sorted(buckets, reverse=True):
            # A warm-up call outside capture, on a side stream as capture itself runs: kernels
            # compile, libraries pick their algorithms and the allocator settles. max_context
            # is 1: a captured backend must not depend on it.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self.forward(bucket, 1)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.forward(bucket, 1)
            self.graphs[bucket] = graph
            progress.advance()
        torch.cuda.synchronize(device)
        progress.finish()

    def run(self, bucket: int, max_context: int) -> tuple[torch.Tensor, ...]:
        """The step's outputs over `bucket` rows: a graph's (overwritten by its next replay) or fresh ones."""
        graph = self.graphs.get(bucket)
        if graph is None:
            return self.forward(bucket, max_context)
        graph.replay()
        return self.outputs[bucket]
