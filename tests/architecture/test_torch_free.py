"""The processes that hold no tensors never import torch: the daemon (and the CLI that starts it), the
router, and the tokenizer, detokenizer and scheduler stages, which are spawned. Only the runner and the
server it forks from do (stages/gpu_runner/). Read from what importing them loads, in a fresh
interpreter; tests/daemon/test_daemon_e2e.py checks the live processes of a running daemon."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipeline.engine.supervision import PRELOAD_MODULES, RUNNER_MODULE
from stages.contracts.topology import STAGES

REPO = Path(__file__).resolve().parents[2]
# The daemon's and the router's own modules: what `pipeline start` and `pipeline router` import.
PRODUCT_MODULES = ["pipeline.cli", "pipeline.options", "pipeline.serve.daemon", "pipeline.serve.server",
                   "pipeline.serve.model", "pipeline.engine.multiprocess", "pipeline.models.checkpoints",
                   "pipeline.router.main"]
# Imports each module in turn; prints the first that brought torch in, or null.
_FIRST_TORCH = """import importlib, json, sys
first = None
for name in sys.argv[1:]:
    importlib.import_module(name)
    if "torch" in sys.modules:
        first = name
        break
print(json.dumps(first))
"""


def first_importing_torch(modules: list[str]) -> str | None:
    done = subprocess.run([sys.executable, "-c", _FIRST_TORCH, *modules], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_stages_that_hold_no_tensors_import_no_torch() -> None:
    spawned = sorted({stage.module for stage in STAGES} - {RUNNER_MODULE})
    assert {"stages.tokenizer.stage", "stages.detokenizer.stage", "stages.scheduler.stage"} <= set(spawned)
    assert first_importing_torch(spawned) is None
    assert set(PRELOAD_MODULES).isdisjoint(spawned)  # the runners' server serves runners alone


def test_the_daemon_and_the_router_import_no_torch() -> None:
    assert first_importing_torch(PRODUCT_MODULES) is None


def test_the_runner_imports_torch_so_the_check_can_fail() -> None:
    assert first_importing_torch(["stages.tokenizer.stage", "stages.gpu_runner.stage"]) == "stages.gpu_runner.stage"


# Builds each model given and runs a step on the CPU; prints whether torch._dynamo and triton came in.
_RUNNER_IMPORTS = """import json, sys
from pipeline import LLM, SamplingParams
for model in sys.argv[1:]:
    llm = LLM(model, device="cpu", max_model_len=64, num_kv_blocks=16, block_size=16)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2))
print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "triton": "triton" in sys.modules}))
"""


def test_a_cpu_runner_imports_neither_dynamo_nor_triton(tmp_path: Path) -> None:
    """The layers are built without torch's random init, which on the meta device imports
    torch._dynamo and, through it, Triton's library: 60+ MB resident in a runner that needs neither
    (the attention backend on the CPU is torch)."""
    from pipeline.models.tiny_model import make_tiny_model

    models = [str(make_tiny_model(tmp_path / arch, arch, seed=1)) for arch in ("llama", "gemma3", "gpt_oss")]
    done = subprocess.run([sys.executable, "-c", _RUNNER_IMPORTS, *models], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"dynamo": False, "triton": False}
