"""`pipeline start` sizes the KV cache in blocks (--num-kv-blocks) or in tokens (--kv-cache-tokens), not both."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import build_parser
from pipeline.errors import PipelineError
from pipeline.options import engine_config


def num_kv_blocks(model: Path, *options: str) -> int | None:
    return engine_config(build_parser().parse_args(["start", "--model", str(model), *options])).num_kv_blocks


@pytest.fixture
def model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")  # a checkpoint directory, as far as option parsing looks
    return tmp_path


def test_tokens_become_whole_blocks(model: Path) -> None:
    assert num_kv_blocks(model, "--kv-cache-tokens", "8192") == 512
    assert num_kv_blocks(model, "--kv-cache-tokens", "8193") == 513
    assert num_kv_blocks(model, "--kv-cache-tokens", "8192", "--block-size", "32") == 256
    assert num_kv_blocks(model, "--num-kv-blocks", "64") == 64
    assert num_kv_blocks(model) is None  # sized by memory in the runner


def test_both_sizes_at_once_are_refused(model: Path) -> None:
    with pytest.raises(PipelineError, match="--kv-cache-tokens and --num-kv-blocks"):
        num_kv_blocks(model, "--kv-cache-tokens", "8192", "--num-kv-blocks", "64")
