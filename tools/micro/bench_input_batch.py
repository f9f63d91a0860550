"""Reordering the persistent batch: full-row swaps vs active-prefix swaps vs permanent rows.

DESIGN §5's scenario: 512 requests, max_model_len 32768, active lengths uniform in 512-2048,
1000 random swaps. Measured side by side in one run, on host numpy tables (as vLLM's CPU-side
input batch keeps them):
  (a) full_row:   each swap copies both whole rows of the token table and the block table,
                  plus the per-row scalars (vLLM before PR 34733);
  (b) prefix:     each swap copies only max(len_a, len_b) tokens and the blocks they use;
  (c) ours:       rows never move; each swap permutes an index array, then one gather builds
                  the step's inputs (last tokens and block-table rows) in the new order, with
                  torch, as the runner does on its device.

Usage: python tools/micro/bench_input_batch.py [--json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

NUM_REQUESTS = 512
MAX_MODEL_LEN = 32768
BLOCK_SIZE = 16
NUM_SWAPS = 1000


class HostTables:
    def __init__(self, lengths: np.ndarray, rng: np.random.Generator) -> None:
        self.token_ids = np.zeros((NUM_REQUESTS, MAX_MODEL_LEN), dtype=np.int32)
        for row, length in enumerate(lengths):
            self.token_ids[row, :length] = rng.integers(0, 32000, length, dtype=np.int32)
        self.block_table = np.zeros((NUM_REQUESTS, MAX_MODEL_LEN // BLOCK_SIZE), dtype=np.int32)
        for row, length in enumerate(lengths):
            num_blocks = -(-length // BLOCK_SIZE)
            self.block_table[row, :num_blocks] = np.arange(num_blocks) + row * 128
        self.num_tokens = lengths.astype(np.int32).copy()
        self.num_prompt_tokens = (lengths // 2).astype(np.int32)
        self.temperature = np.ones(NUM_REQUESTS, dtype=np.float32)


def swap_full_rows(t: HostTables, pairs: np.ndarray) -> None:
    for a, b in pairs.tolist():
        t.token_ids[[a, b]] = t.token_ids[[b, a]]
        t.block_table[[a, b]] = t.block_table[[b, a]]
        for array in (t.num_tokens, t.num_prompt_tokens, t.temperature):
            array[[a, b]] = array[[b, a]]


def swap_active_prefix(t: HostTables, pairs: np.ndarray) -> None:
    for a, b in pairs.tolist():
        n = int(max(t.num_tokens[a], t.num_tokens[b]))
        tmp = t.token_ids[a, :n].copy()
        t.token_ids[a, :n] = t.token_ids[b, :n]
        t.token_ids[b, :n] = tmp
        num_blocks = -(-n // BLOCK_SIZE)
        tmp_blocks = t.block_table[a, :num_blocks].copy()
        t.block_table[a, :num_blocks] = t.block_table[b, :num_blocks]
        t.block_table[b, :num_blocks] = tmp_blocks
        for array in (t.num_tokens, t.num_prompt_tokens, t.temperature):
            array[[a, b]] = array[[b, a]]


def permute_and_gather(token_ids: torch.Tensor, block_table: torch.Tensor, num_tokens: np.ndarray,
                       pairs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    order = np.arange(NUM_REQUESTS, dtype=np.int64)
    for a, b in pairs.tolist():
        order[[a, b]] = order[[b, a]]
    # One step's inputs in the new order: each row's last token and its block-table prefix.
    rows = torch.from_numpy(order)
    last = torch.from_numpy(num_tokens[order].astype(np.int64) - 1)
    input_ids = token_ids[rows, last]
    max_blocks = -(-int(num_tokens.max()) // BLOCK_SIZE)
    blocks = block_table[rows, :max_blocks]
    return input_ids, blocks


def _time_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def run(repeats: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    lengths = rng.integers(512, 2049, NUM_REQUESTS)
    pairs = rng.integers(0, NUM_REQUESTS, (NUM_SWAPS, 2))
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    full = HostTables(lengths, rng)
    prefix = HostTables(lengths, rng)
    token_ids = torch.from_numpy(full.token_ids.copy())
    block_table = torch.from_numpy(full.block_table.copy())

    # Correctness first: all three orders must agree on what the step would read.
    check_full = HostTables(lengths, np.random.default_rng(1))
    check_prefix = HostTables(lengths, np.random.default_rng(1))
    swap_full_rows(check_full, pairs)
    swap_active_prefix(check_prefix, pairs)
    reference = torch.from_numpy(HostTables(lengths, np.random.default_rng(1)).token_ids)
    ids, _ = permute_and_gather(reference, torch.from_numpy(check_full.block_table), lengths, pairs)
    last_full = check_full.token_ids[np.arange(NUM_REQUESTS), check_full.num_tokens - 1]
    last_prefix = check_prefix.token_ids[np.arange(NUM_REQUESTS), check_prefix.num_tokens - 1]
    if not (np.array_equal(last_full, last_prefix) and np.array_equal(last_full, ids.numpy())):
        raise RuntimeError("the three reorderings disagree")

    full_ms = _time_ms(lambda: swap_full_rows(full, pairs), repeats)
    prefix_ms = _time_ms(lambda: swap_active_prefix(prefix, pairs), repeats)
    ours_ms = _time_ms(lambda: permute_and_gather(token_ids, block_table, lengths, pairs), repeats)
    return {
        "full_row_ms": round(full_ms, 3),
        "prefix_ms": round(prefix_ms, 3),
        "ours_ms": round(ours_ms, 3),
        "speedup": round(full_ms / ours_ms, 2),
        "prefix_speedup": round(full_ms / prefix_ms, 2),
        "num_swaps": int(len(pairs)),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--quick", action="store_true", help="one timed run each instead of five")
    args = parser.parse_args(argv)
    result = run(repeats=1 if args.quick else 5)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{NUM_REQUESTS} requests, max_model_len {MAX_MODEL_LEN}, {result['num_swaps']} swaps "
          f"(median of {result['repeats']})")
    print(f"{'method':<34}{'ms':>10}{'vs full row':>14}")
    for name, key in (("(a) full-row swaps", "full_row_ms"), ("(b) active-prefix swaps", "prefix_ms"),
                      ("(c) permanent rows + gather (ours)", "ours_ms")):
        print(f"{name:<34}{result[key]:>10.3f}{result['full_row_ms'] / result[key]:>13.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
