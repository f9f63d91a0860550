"""Serving benchmark against a running daemon: latency (TTFT, TPOT, ITL, E2EL) and throughput.

Usage: python tools/bench_serve.py [--socket PATH] [--num-prompts N] [--request-rate R]
       [--max-concurrency C] [--input-len MIN[:MAX]] [--output-len MIN[:MAX]] [--dataset FILE.jsonl]
       [--json [FILE]] [--plot FILE.png] [--compare-sync --model DIR] ...
See `--help`, and pipeline/serve_bench.py for the metric definitions.
"""
from __future__ import annotations

import sys

import checkout_path  # noqa: E402,F401 - first: the checkout on sys.path, not tools/ (see there)

from pipeline.bench.serve_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
