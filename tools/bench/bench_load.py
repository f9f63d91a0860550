"""Load-to-ready time of one model served as its GGUF file and as a safetensors checkpoint.

The safetensors checkpoint is made from the GGUF file here (its tensors dequantized to float32,
the same config, tokenizer and chat template), so both serve the same weights. Each round starts
`pipeline start` on each, alternating, and times it from the process start until the daemon has
answered a one-token request; the GGUF's first start also builds its metadata directory (cold),
the later ones reuse it (warm).

    python tools/bench/bench_load.py [--model FILE.gguf] [--rounds N] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.client import Client
from pipeline.errors import PipelineError
from pipeline.models.checkpoints import default_model_file, resolve_model
from stages.gpu_runner.loaders.gguf import GGUFSource
from stages.gpu_runner.models.config import load_model_config

START_TIMEOUT_S = 300.0
OPTIONS = ["--device", "cpu", "--max-model-len", "2048", "--num-kv-blocks", "256"]


def safetensors_copy(gguf: Path, target: Path) -> Path:
    """A safetensors checkpoint of the GGUF file's model (float32), beside its config and tokenizer."""
    from safetensors.torch import save_file

    served = Path(resolve_model(gguf))
    target.mkdir(parents=True)
    config = json.loads((served / "config.json").read_text())
    source = GGUFSource(gguf, load_model_config(served))
    save_file({name: source.read(name).contiguous() for name in source.names()}, str(target / "model.safetensors"))
    del config["gguf_file"]
    config["torch_dtype"] = "float32"
    (target / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(served / name, target / name)
    return target


def time_to_ready(model: Path, run_dir: Path, env: dict[str, str]) -> float:
    """Seconds from `pipeline start` to the daemon's first answered one-token request."""
    run_dir.mkdir(mode=0o700)
    socket_path = run_dir / "pipeline.sock"
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "start", "--model", str(model), "--socket",
                                str(socket_path), *OPTIONS], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                               env=env)
    try:
        while time.perf_counter() - start < START_TIMEOUT_S:
            if process.poll() is not None:
                raise RuntimeError(f"the daemon serving {model} exited with {process.returncode}")
            try:
                with Client(socket_path, timeout_s=60) as client:
                    client.generate([1, 2, 3], {"max_tokens": 1})
                return time.perf_counter() - start
            except (OSError, PipelineError):
                time.sleep(0.02)
        raise RuntimeError(f"the daemon serving {model} was not ready in {START_TIMEOUT_S} s")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the default model's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    gguf = args.model or default_model_file()
    scratch = Path(tempfile.mkdtemp(prefix="bench-load-"))
    try:
        cache = scratch / "cache"  # a cache of its own, so the first GGUF start is cold
        env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
        cold = time_to_ready(gguf, scratch / "cold", env)
        os.environ["XDG_CACHE_HOME"] = str(cache)
        checkpoint = safetensors_copy(gguf, scratch / "safetensors")
        times: dict[str, list[float]] = {"gguf": [], "safetensors": []}
        for index in range(args.rounds):
            times["gguf"].append(time_to_ready(gguf, scratch / f"g{index}", env))
            times["safetensors"].append(time_to_ready(checkpoint, scratch / f"s{index}", env))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    gguf_s, st_s = statistics.median(times["gguf"]), statistics.median(times["safetensors"])
    result = {"model": gguf.name, "gguf_bytes": gguf.stat().st_size, "rounds": args.rounds,
              "gguf_cold_s": round(cold, 2), "gguf_warm_s": round(gguf_s, 2), "safetensors_s": round(st_s, 2),
              "ratio_warm": round(gguf_s / st_s, 2), "ratio_cold": round(cold / st_s, 2),
              "gguf_runs_s": [round(t, 2) for t in times["gguf"]],
              "safetensors_runs_s": [round(t, 2) for t in times["safetensors"]]}
    if args.json:
        print(json.dumps(result))
        return
    print(f"load to ready: {gguf.name} ({result['gguf_bytes'] / 1e6:.0f} MB), median of {args.rounds} runs")
    print(f"{'format':<24}{'seconds':>9}{'vs safetensors':>16}")
    print(f"{'safetensors (float32)':<24}{st_s:>9.2f}{1.0:>15.2f}x")
    print(f"{'GGUF, warm':<24}{gguf_s:>9.2f}{gguf_s / st_s:>15.2f}x")
    print(f"{'GGUF, first start':<24}{cold:>9.2f}{cold / st_s:>15.2f}x")


if __name__ == "__main__":
    main()
