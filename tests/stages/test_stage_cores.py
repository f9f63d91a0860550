"""A model on the CPU, where each stage runs: split (the runner on all cores but one,
the other stages on that one) or shared (the runner on every core, the others anywhere), auto
splitting from SPLIT_MIN_CORES cores on; left alone on a GPU, under tensor parallelism and on one
core. And `pipeline start`'s step token budget there."""
from __future__ import annotations

import pytest

from stages.contracts.config import EngineConfig
from stages.process import SPLIT_MIN_CORES, stage_cores

OTHERS = ("tokenizer0", "scheduler", "detokenizer")


def test_split_gives_the_runner_all_cores_but_the_last() -> None:
    config = EngineConfig(model="m", device="cpu", cpu_placement="split")
    assert stage_cores("runner", config, [0, 1, 2, 3]) == [0, 1, 2]
    for name in OTHERS:
        assert stage_cores(name, config, [0, 1, 2, 3]) == [3]


def test_shared_gives_the_runner_every_core_and_leaves_the_others_alone() -> None:
    config = EngineConfig(model="m", device="cpu", cpu_placement="shared")
    assert stage_cores("runner", config, [0, 1]) == [0, 1]
    for name in OTHERS:
        assert stage_cores(name, config, [0, 1]) is None


def test_auto_shares_few_cores_and_splits_many() -> None:
    config = EngineConfig(model="m", device="cpu")
    few, many = list(range(SPLIT_MIN_CORES - 1)), list(range(SPLIT_MIN_CORES))
    assert stage_cores("runner", config, few) == few
    assert stage_cores("scheduler", config, few) is None
    assert stage_cores("runner", config, many) == many[:-1]
    assert stage_cores("scheduler", config, many) == many[-1:]


def test_a_bad_placement_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="cpu_placement"):
        EngineConfig(model="m", device="cpu", cpu_placement="pinned")


def test_placement_is_left_alone_where_it_cannot_help() -> None:
    assert stage_cores("runner", EngineConfig(model="m", device="cpu"), [5]) is None
    assert stage_cores("runner", EngineConfig(model="m", device="cuda"), [0, 1]) is None
    assert stage_cores("runner", EngineConfig(model="m", device="cpu", tensor_parallel_size=2), [0, 1]) is None


def test_pipeline_start_takes_a_smaller_step_token_budget_for_a_model_on_the_cpu(tmp_path) -> None:
    from pipeline.cli import build_parser
    from pipeline.options import engine_config
    from pipeline.models.tiny_model import make_tiny_model
    from stages.contracts.config import CPU_MAX_NUM_BATCHED_TOKENS

    model = str(make_tiny_model(tmp_path / "tiny", "llama", seed=0))

    def budget(*options: str) -> int:
        return engine_config(build_parser().parse_args(["start", "--model", model, *options])).max_num_batched_tokens

    assert budget("--device", "cpu") == CPU_MAX_NUM_BATCHED_TOKENS
    assert budget("--device", "cuda") == EngineConfig().max_num_batched_tokens
    assert budget("--device", "cpu", "--max-num-batched-tokens", "4096") == 4096
