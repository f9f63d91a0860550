"""What verifying drafts costs on the device, measured at start-up: the fit, and what a runner reports."""
from __future__ import annotations

import pytest
import torch

from runner_plans import make_runner
from stages.contracts.config import EngineConfig
from stages.gpu_runner import runner as runner_module
from stages.gpu_runner.build import model_limits
from stages.gpu_runner.speculative import verify_cost

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def step(monkeypatch: pytest.MonkeyPatch):
    """step(c0, c1): a step over n rows that costs c0 + c1 * n ms on a clock of its own (verify_cost's)."""
    clock = [0.0]
    monkeypatch.setattr(verify_cost.time, "perf_counter", lambda: clock[0])

    def make(c0: float, c1: float):
        def run(n: int) -> None:
            clock[0] += (c0 + c1 * n) / 1000
        return run
    return make


def test_the_cost_of_verifying_is_fitted_from_two_timed_steps(step) -> None:
    """A step of n tokens that costs 10 + 0.5 n (ms) has F = c0 / c1 = 20; one whose cost does not
    grow with its tokens reports drafts as free; one without a fixed cost, fitted FITS times, says
    that no draft pays (F = 0), and a contradicting fit is taken again before it is believed."""
    cpu = torch.device("cpu")
    assert verify_cost.measure(step(10, 0.5), 16, 4, cpu).free_tokens == pytest.approx(20)
    assert verify_cost.measure(step(10, 0.0), 16, 4, cpu).free_tokens == verify_cost.MAX_FREE_TOKENS
    # five times the tokens costing more than five times as much, every time: no draft pays
    assert verify_cost.measure(step(-2, 1.0), 16, 4, cpu).free_tokens == 0.0
    # ...once only (a busy moment): the next fit is the measurement
    calls = [0]
    noisy, steady = step(-2, 1.0), step(10, 0.5)

    def once_noisy(n: int) -> None:
        calls[0] += 1
        (noisy if calls[0] <= 2 * (1 + verify_cost.REPEATS) else steady)(n)

    assert verify_cost.measure(once_noisy, 16, 4, cpu).free_tokens == pytest.approx(20)


def test_a_draft_models_decoding_is_measured_in_the_targets_tokens(step) -> None:
    """A draft step over n rows costing 4 + 0.25 n (ms) beside a target's 10 + 0.5 n: (8, 0.5) target tokens."""
    costs = verify_cost.measure(step(10, 0.5), 16, 4, torch.device("cpu"), draft_step=step(4, 0.25))
    assert costs.free_tokens == pytest.approx(20) and costs.draft_step == pytest.approx((8, 0.5))
    # where the target's fits all say no draft pays (a busy machine), the draft's decoding is still reported
    costs = verify_cost.measure(step(-2, 1.0), 16, 4, torch.device("cpu"), draft_step=step(4, 0.25))
    assert costs.free_tokens == 0.0 and costs.draft_step == pytest.approx((4, 0.25))
    # where the target's extra tokens cost nothing measurable (F at its cap), the draft's decoding is
    # still a cost, in the c1 that F implies: c1 = 10 ms / (cap + 16)
    costs = verify_cost.measure(step(10, 0.0), 16, 4, torch.device("cpu"), draft_step=step(4, 0.25))
    unit = 10 / (verify_cost.MAX_FREE_TOKENS + 16)
    assert costs.free_tokens == verify_cost.MAX_FREE_TOKENS
    assert costs.draft_step == pytest.approx((4 / unit, 0.25 / unit))


def test_a_speculative_runner_measures_what_a_verified_draft_costs(tiny_checkpoint,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(verify_cost.FIXED_VARIABLE, raising=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    runner = make_runner(tiny_checkpoint("llama"), num_kv_blocks=16, max_num_seqs=4, speculative_config=spec)
    assert runner.verify_free_tokens is not None and runner.verify_free_tokens >= 0
    assert model_limits(runner, EngineConfig(model="x", speculative_config=spec)).verify_free_tokens == \
        runner.verify_free_tokens
    assert make_runner(tiny_checkpoint("llama"), num_kv_blocks=16, max_num_seqs=4).verify_free_tokens is None


def test_a_draft_model_runner_measures_its_drafts_decoding_too(tiny_checkpoint,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(verify_cost.FIXED_VARIABLE, raising=False)
    checkpoint = tiny_checkpoint("llama")
    spec = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}
    runner = make_runner(checkpoint, num_kv_blocks=16, max_num_seqs=4, speculative_config=spec)
    if runner.verify_free_tokens is None:
        pytest.skip("the machine was too busy for a cost fit")
    fixed, per_row = runner.step_costs.draft_step
    # the draft is the target itself: one decode step costs about one step of the target
    assert fixed >= 0 and per_row >= 0 and fixed + per_row * 4 > 0
    limits = model_limits(runner, EngineConfig(model="x", speculative_config=spec))
    assert limits.draft_step_tokens == runner.step_costs.draft_step


def test_a_fixed_cost_replaces_the_measurement(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(n: int) -> None:
        raise AssertionError("measured although fixed")

    cpu = torch.device("cpu")
    monkeypatch.setenv(verify_cost.FIXED_VARIABLE, "none")
    assert verify_cost.start_up_costs(never, 16, 4, cpu, draft_step=never) == verify_cost.StepCosts(None)
    monkeypatch.setenv(verify_cost.FIXED_VARIABLE, "7.5")
    assert verify_cost.start_up_costs(never, 16, 4, cpu, draft_step=never) == verify_cost.StepCosts(7.5)
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv(verify_cost.FIXED_VARIABLE, bad)
        with pytest.raises(ValueError, match=verify_cost.FIXED_VARIABLE):
            verify_cost.start_up_costs(never, 16, 4, cpu)


def test_a_model_with_local_layers_measures_its_cost_too(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3's local layers have a KV group of their own: the timed steps write its scratch block too."""
    monkeypatch.delenv(verify_cost.FIXED_VARIABLE, raising=False)
    timed = []

    def spy(step, rows, k, device, draft_step=None):
        timed.append(rows)
        return verify_cost.measure(step, rows, k, device, draft_step)

    monkeypatch.setattr(runner_module, "start_up_costs", spy)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    runner = make_runner(tiny_checkpoint("gemma3"), num_kv_blocks=16, max_num_seqs=4, speculative_config=spec)
    assert runner.num_window_blocks > 0 and timed == [4]


def test_a_draft_pays_only_where_decoding_it_costs_less_than_verifying_saves() -> None:
    assert verify_cost.StepCosts(10.0, (3.0, 1.0)).draft_pays
    assert not verify_cost.StepCosts(10.0, (9.0, 1.0)).draft_pays  # (1 + 9 + 1) / (10 + 1): the bar is 1
    assert not verify_cost.StepCosts(0.0).draft_pays  # a step with no fixed cost: nothing pays
    assert verify_cost.StepCosts(None, (50.0, 50.0)).draft_pays  # not measured: taken as free


@pytest.mark.parametrize("costs, runs", [((2.0, (1.5, 1.0)), False), ((20.0, (1.5, 1.0)), True)])
def test_a_draft_model_that_cannot_pay_is_not_run(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch,
                                                  costs, runs) -> None:
    """Measured as slow as the target (the draft is the target here), the draft model decodes nothing:
    no step runs it to keep its KV, and the outputs are the target's alone."""
    from runner_plans import PlannedRequest, run_requests

    monkeypatch.setattr(runner_module, "start_up_costs", lambda *args, **kwargs: verify_cost.StepCosts(*costs))
    checkpoint = tiny_checkpoint("llama")
    spec = {"method": "draft_model", "model": str(checkpoint), "num_speculative_tokens": 3}
    runner = make_runner(checkpoint, num_kv_blocks=16, max_num_seqs=4, speculative_config=spec)
    observed = []
    monkeypatch.setattr(runner.speculator.draft, "observe", lambda *args: observed.append(args))
    outputs = run_requests(runner, [PlannedRequest([1, 2, 3, 4], 5)], token_budget=64)
    assert runner.draft_runs is runs and bool(observed) is runs
    assert len(outputs[0]) == 5


def test_the_cost_is_fitted_at_each_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose kernels change past 8 rows (10 + 0.1 n ms up to 8 rows, 10 + n beyond): at one
    row drafts are nearly free (F = 100), at 4 rows verifying 20 costs dear (F = 4.5), at 16 and 32 F = 10.
    free_tokens is the largest batch's fit; a batch above the model's rows is not timed."""
    clock = [0.0]
    monkeypatch.setattr(verify_cost.time, "perf_counter", lambda: clock[0])

    def step(n: int) -> None:
        clock[0] += (10 + (0.1 if n <= 8 else 1.0) * n) / 1000

    costs = verify_cost.measure_by_batch(step, 64, 4, torch.device("cpu"))
    assert [fit[0] for fit in costs.by_batch] == list(verify_cost.COST_BATCHES) == [1, 4, 16, 32]
    assert [fit[1] for fit in costs.by_batch] == pytest.approx([100, 5.5 / 1.225, 10, 10])
    assert costs.free_tokens == pytest.approx(10)
    assert [fit[0] for fit in verify_cost.measure_by_batch(step, 3, 4, torch.device("cpu")).by_batch] == [1, 3]
