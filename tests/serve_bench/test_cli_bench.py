"""`pipeline bench` is the load generator behind the main command line."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main


@pytest.mark.timeout(20)
def test_pipeline_bench_reaches_the_load_generator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "none.sock"
    assert main(["bench", "--socket", str(missing), "--num-prompts", "2"]) == 1
    assert str(missing) in capsys.readouterr().err


@pytest.mark.timeout(20)
def test_pipeline_bench_help_lists_workload_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--request-rate" in out and "--max-concurrency" in out
