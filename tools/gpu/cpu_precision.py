"""How exact float32 is on this machine's CPU, and what "auto" means there: the linear layer's three
paths and attention against float64, and a tiny engine's float32 greedy tokens with their top-2
log-probabilities, as JSON.

The CPU engines the tests compare with run on the GPU machine's CPU. On the first one, tests that
left the dtype to "auto" parted at near-ties: "auto" is bfloat16 on a CPU with bf16 instructions,
and making it see one here fails the same tests. The report names the CPU, its bf16 flags and the
dtype "auto" picks, beside the float32 errors.

    python tools/gpu/cpu_precision.py [--out FILE]

Each variant runs in a process of its own: as is, with the dense layers through plain F.linear
(not oneDNN's packed weights), and on one thread.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
# The tiny llama and first prompt of tests/gpu_runner/test_runner_cuda.py's speculative test (its
# seed is tests/gpu_runner/conftest.py's ARCH_SEEDS["llama"]).
SEED = 11
PROMPT = [11, 12, 13, 14] * 6
VARIANTS = {"as-is": {}, "plain-linear": {}, "one-thread": {"OMP_NUM_THREADS": "1"}}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def linear_errors() -> dict[str, dict[str, float]]:
    """Each path's largest error relative to the float64 product, for a few batch sizes."""
    from stages.gpu_runner.layers.quantization.dense import packed_weight

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 576, generator=gen)
    errors = {}
    for rows in (1, 3, 32, 512):
        x = torch.randn(rows, 576, generator=gen)
        want = x.double() @ weight.double().T
        packed = torch.ops.mkldnn._linear_pointwise(x, packed_weight(weight), None, "none", [], "")
        errors[str(rows)] = {"F.linear": relative_error(F.linear(x, weight), want),
                             "onednn-packed": relative_error(packed, want),
                             "matmul": relative_error(x @ weight.T, want)}
    return errors


def attention_error() -> float:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 40, 64, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    return relative_error(F.scaled_dot_product_attention(q, k, v, is_causal=True), want)


def engine_tokens() -> dict[str, list]:
    """The tiny llama's greedy tokens after PROMPT, with each step's two best log-probabilities."""
    from pipeline import LLM, SamplingParams
    from pipeline.models.tiny_model import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp()), "llama", seed=SEED, rope_scaling_llama3=True)
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=4, block_size=16, max_model_len=256)
    out = llm.generate([PROMPT], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)])[0]
    return {"tokens": list(out.token_ids), "top2": [sorted(lp.values(), reverse=True)[:2] for lp in out.logprobs]}


def run_variant(name: str) -> dict:
    if name == "plain-linear":
        from stages.gpu_runner.layers.quantization import dense

        dense.DenseMethod.apply = lambda self, weight, x, bias: F.linear(x, weight, bias)
    return {"threads": torch.get_num_threads(), "linear": linear_errors(), "attention": attention_error(),
            "engine": engine_tokens()}


def machine() -> dict:
    from stages.gpu_runner.models.config import BF16_CPU_FLAGS, cpu_auto_dtype, cpu_flags

    flags = cpu_flags(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").exists() else frozenset()
    facts = {"torch": torch.__version__, "bf16_flags": sorted(flags & BF16_CPU_FLAGS),
             "auto_dtype": str(cpu_auto_dtype(flags)).removeprefix("torch."),
             "capability": torch.backends.cpu.get_cpu_capability(),
             "threads": torch.get_num_threads(), "float32_matmul_precision": torch.get_float32_matmul_precision(),
             "mkldnn_matmul_fp32_precision": getattr(torch.backends.mkldnn.matmul, "fp32_precision", None)}
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
        facts["lscpu"] = [line for line in lines if line.startswith(("Model name", "CPU(s)", "Flags"))]
    except (OSError, subprocess.TimeoutExpired):
        facts["lscpu"] = None
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant)))
        return
    report = {"machine": machine(), "variants": {}}
    for name, env in VARIANTS.items():
        run = subprocess.run([sys.executable, __file__, "--variant", name], capture_output=True, text=True,
                             env=os.environ | env, timeout=120, cwd=ROOT)
        lines = run.stdout.strip().splitlines()
        report["variants"][name] = json.loads(lines[-1]) if run.returncode == 0 and lines else {
            "error": run.stderr[-2000:]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
