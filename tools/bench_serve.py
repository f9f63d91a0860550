"""Serving benchmark against a running daemon: latency (TTFT, TPOT, ITL, E2EL) and throughput.

Usage: python tools/bench_serve.py [--socket PATH] [--num-prompts N] [--request-rate R]
       [--max-concurrency C] [--input-len MIN[:MAX]] [--output-len MIN[:MAX]] [--dataset FILE.jsonl]
       [--json [FILE]] [--plot FILE.png] [--compare-sync --model DIR] ...
See `--help`, and pipeline/serve_bench.py for the metric definitions.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from pipeline.serve_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
