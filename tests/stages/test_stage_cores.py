"""Where each stage runs when the model runs on the CPU: the runner on all cores but one, the
other stages on that one; left alone on a GPU, under tensor parallelism and on one core."""
from __future__ import annotations

from stages.contracts.config import EngineConfig
from stages.process import stage_cores


def test_the_runner_owns_all_cores_but_the_last() -> None:
    config = EngineConfig(model="m", device="cpu")
    assert stage_cores("runner", config, [0, 1, 2, 3]) == [0, 1, 2]
    for name in ("tokenizer0", "scheduler", "detokenizer"):
        assert stage_cores(name, config, [0, 1, 2, 3]) == [3]


def test_placement_is_left_alone_where_it_cannot_help() -> None:
    assert stage_cores("runner", EngineConfig(model="m", device="cpu"), [5]) is None
    assert stage_cores("runner", EngineConfig(model="m", device="cuda"), [0, 1]) is None
    assert stage_cores("runner", EngineConfig(model="m", device="cpu", tensor_parallel_size=2), [0, 1]) is None
