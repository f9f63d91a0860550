"""What verifying drafts costs on the device, measured at start-up: the fit, and what a runner reports."""
from __future__ import annotations

import pytest
import torch

from runner_plans import make_runner
from stages.contracts.config import EngineConfig
from stages.gpu_runner.build import model_limits
from stages.gpu_runner.speculative import verify_cost

pytestmark = pytest.mark.timeout(60)


def test_the_cost_of_verifying_is_fitted_from_two_timed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of n tokens that costs 10 + 0.5 n (ms) has F = c0 / c1 = 20; one whose cost does not
    grow with its tokens reports drafts as free; a fit without a fixed cost is no measurement."""
    clock = [0.0]
    monkeypatch.setattr(verify_cost.time, "perf_counter", lambda: clock[0])

    def step(c0: float, c1: float):
        def run(n: int) -> None:
            clock[0] += (c0 + c1 * n) / 1000
        return run

    assert verify_cost.measure_free_tokens(step(10, 0.5), 16, 4, torch.device("cpu")) == pytest.approx(20)
    assert verify_cost.measure_free_tokens(step(10, 0.0), 16, 4, torch.device("cpu")) == verify_cost.MAX_FREE_TOKENS
    # five times the tokens costing more than five times as much: noise, not a measurement
    assert verify_cost.measure_free_tokens(step(-2, 1.0), 16, 4, torch.device("cpu")) is None


def test_a_speculative_runner_measures_what_a_verified_draft_costs(tiny_checkpoint,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(verify_cost.FIXED_VARIABLE, raising=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    runner = make_runner(tiny_checkpoint("llama"), num_kv_blocks=16, max_num_seqs=4, speculative_config=spec)
    assert runner.verify_free_tokens is not None and runner.verify_free_tokens >= 0
    assert model_limits(runner, EngineConfig(model="x", speculative_config=spec)).verify_free_tokens == \
        runner.verify_free_tokens
    assert make_runner(tiny_checkpoint("llama"), num_kv_blocks=16, max_num_seqs=4).verify_free_tokens is None


def test_a_fixed_cost_replaces_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(n: int) -> None:
        raise AssertionError("measured although fixed")

    cpu = torch.device("cpu")
    monkeypatch.setenv(verify_cost.FIXED_VARIABLE, "none")
    assert verify_cost.start_up_free_tokens(never, 16, 4, cpu) is None
    monkeypatch.setenv(verify_cost.FIXED_VARIABLE, "7.5")
    assert verify_cost.start_up_free_tokens(never, 16, 4, cpu) == 7.5
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(verify_cost.FIXED_VARIABLE, bad)
        with pytest.raises(ValueError, match=verify_cost.FIXED_VARIABLE):
            verify_cost.start_up_free_tokens(never, 16, 4, cpu)
