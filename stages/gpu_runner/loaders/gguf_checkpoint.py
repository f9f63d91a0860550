"""A GGUF file served as it is: beside it, a small directory holds what every stage reads of a
checkpoint (config.json naming the file for its weights, tokenizer.json, tokenizer_config.json
with the chat template), all built from the file's metadata.

The directory lives in a cache, keyed by the file's path, size and modification time, and is
built once (into a temporary directory renamed into place, so two starts never see half of it).
The weights are never copied: the runner reads and dequantizes them from the GGUF file itself.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from stages.gpu_runner.loaders.gguf_file import GGUFFile
from stages.progress import Progress

LAYOUT_VERSION = 1  # bump when what is written here changes, so older directories are rebuilt
_DONE = "config.json"  # written last: its presence marks a finished directory


def check_tensors(file: GGUFFile, arch: str) -> None:
    """Every tensor is one the engine knows, of a quant type it dequantizes: else an error naming it."""
    # Here, not at the top: they import torch, and gguf_source_of serves processes that never do.
    from stages.gpu_runner.loaders.gguf import hf_name
    from stages.gpu_runner.loaders.gguf_quants import SUPPORTED_TYPES, UnsupportedQuantType
    from stages.gpu_runner.models.config import ModelLoadError

    for name, info in file.tensors.items():
        if hf_name(name, arch) is None:
            raise ModelLoadError(f"{file.path}: tensor {name} is not known for architecture {arch!r}")
        if info.qtype not in SUPPORTED_TYPES:
            type_name = getattr(info.qtype, "name", str(info.qtype))
            supported = ", ".join(t.name for t in sorted(SUPPORTED_TYPES, key=int))
            raise UnsupportedQuantType(f"{file.path}: tensor {name} has quant type {type_name}, which is not "
                                       f"supported; supported: {supported}")


def _key(path: Path) -> str:
    stat = path.stat()
    text = f"{LAYOUT_VERSION}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def gguf_checkpoint(path: str | Path, cache_root: str | Path) -> Path:
    """The checkpoint directory serving GGUF file `path`, built under `cache_root` if not there yet.
    ModelLoadError (naming the file) for a file that is not GGUF, is truncated, or holds an
    architecture, tensor or quant type the engine does not serve."""
    from stages.gpu_runner.loaders.gguf import hf_config, open_gguf
    from stages.gpu_runner.loaders.gguf_tokenizer import build_tokenizer
    from stages.gpu_runner.models.config import ModelLoadError

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file not found: {path}")
    file = open_gguf(path)
    config = hf_config(file)
    check_tensors(file, file.get("general.architecture"))
    target = Path(cache_root) / f"{path.stem}-{_key(path)}"
    if (target / _DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=target.parent))
    try:
        with Progress(f"building the metadata directory of {path.name} in {target.parent}"):
            tokenizer = build_tokenizer(file, path)
        tokenizer.tokenizer.save(str(scratch / "tokenizer.json"))
        (scratch / "tokenizer_config.json").write_text(json.dumps(tokenizer.tokenizer_config(), indent=2))
        eos = tokenizer.eos_token_ids or ([] if config["eos_token_id"] is None else [config["eos_token_id"]])
        config["eos_token_id"] = eos
        (scratch / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
        config["gguf_file"] = str(path.resolve())
        (scratch / _DONE).write_text(json.dumps(config, indent=2))
        try:
            os.rename(scratch, target)
        except OSError:
            if not (target / _DONE).is_file():
                raise  # not a lost race: something else is in the way
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def gguf_source_of(model_dir: str | Path) -> Path | None:
    """The GGUF file a checkpoint directory serves, or None for an ordinary checkpoint."""
    config_path = Path(model_dir) / _DONE
    try:
        source = json.loads(config_path.read_text()).get("gguf_file")
    except (OSError, ValueError, AttributeError):
        return None
    return None if source is None else Path(source)
