"""A tiny random checkpoint built once into the user's cache: the model of the host-overhead
benchmark (tools/bench/bench_overhead.py) when it is given none, where per-step host work, not the
forward, should dominate. Its text is meaningless (random weights). The daemon's default model is
a real one (checkpoints.py)."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_ARCH = "llama"
DEFAULT_MODEL_SEED = 0
# Files whose presence marks a finished build; the build renames a complete directory into
# place, so a directory holding them is never half-written.
_REQUIRED_FILES = ("config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json")


def _is_current(target: Path) -> bool:
    """A finished build of this version: one made before chat templates is rebuilt."""
    if not all((target / name).is_file() for name in _REQUIRED_FILES):
        return False
    try:
        return "chat_template" in json.loads((target / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def default_model_dir() -> Path:
    """`$XDG_CACHE_HOME/pipeline/default-model`, else `~/.cache/pipeline/default-model`."""
    cache_home = os.environ.get("XDG_CACHE_HOME")
    base = Path(cache_home) if cache_home else Path.home() / ".cache"
    return base / "pipeline" / "default-model"


def ensure_default_model(target: Path | None = None) -> Path:
    """The default model's directory, building it first if it is not there yet.

    The build goes into a temporary directory beside the target and is renamed into place, so
    a crash leaves no partial model and two daemons starting at once both end up with one
    complete copy (the loser of the rename discards its own).
    """
    target = default_model_dir() if target is None else Path(target)
    if _is_current(target):
        return target
    from pipeline.models.tiny_model import make_tiny_model  # imports torch: only when a build is needed

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".default-model-", dir=target.parent))
    try:
        make_tiny_model(scratch, DEFAULT_MODEL_ARCH, DEFAULT_MODEL_SEED)
        if target.is_dir() and not _is_current(target):  # an earlier version's build: replaced
            stale = Path(tempfile.mkdtemp(prefix=".default-model-old-", dir=target.parent))
            os.rename(target, stale / "model")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(scratch, target)
        except OSError:
            if not _is_current(target):
                raise  # not a lost race: something else is in the way
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target
