"""Write a small random HF-format checkpoint (config, safetensors, BPE tokenizer, chat template) for tests and benchmarks.

Usage: python tools/make_tiny_model.py OUTDIR --arch llama|mistral|qwen2|qwen3 [--seed N]
       [--preset tiny|20m|1b] [--hidden-size H] [--num-layers L] [--shards N] [--rope-scaling-llama3]
       [--device cpu|cuda]

--preset 1b has Llama-3.2-1B's shapes (tied embeddings); --device cuda draws its weights on the GPU
in seconds (other values than on the CPU for the same seed).
"""
from __future__ import annotations

import argparse
import sys

from pipeline.models.tiny_model import ARCHITECTURES, PRESETS, make_tiny_model

__all__ = ["make_tiny_model"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir")
    parser.add_argument("--arch", required=True, choices=sorted(ARCHITECTURES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the weights are drawn")
    parser.add_argument("--rope-scaling-llama3", action="store_true", help="llama only: add llama3 rope scaling")
    for name in PRESETS["tiny"]:
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    args = parser.parse_args(argv)
    if args.rope_scaling_llama3 and args.arch != "llama":
        parser.error("--rope-scaling-llama3 applies to --arch llama only")
    sizes = {name: getattr(args, name) for name in PRESETS["tiny"]}
    out = make_tiny_model(args.outdir, args.arch, args.seed, preset=args.preset, shards=args.shards,
                          dtype=args.dtype, rope_scaling_llama3=args.rope_scaling_llama3, device=args.device,
                          **sizes)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
