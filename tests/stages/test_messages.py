"""Binary layouts of the stage records: whatever is encoded decodes to an equal value."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stages.contracts.outputs import OutputEvent
from stages.contracts.params import SamplingParams
from stages import messages as msg
from stages.events import decode_events, encode_events
from stages.contracts.plan import KVCopyMeta, NewRequest, StepPlan
from stages.contracts.outputs import FinishReason

i32 = st.integers(-(2**31), 2**31 - 1)


def int32_arrays(size: int) -> st.SearchStrategy[np.ndarray]:
    return st.lists(i32, min_size=size, max_size=size).map(lambda v: np.array(v, np.int32))


params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096), temperature=st.floats(0, 100), top_p=st.floats(0.01, 1.0),
    top_k=st.integers(-1, 1000), min_p=st.floats(0, 1), seed=st.none() | st.integers(0, 2**63 - 1),
    presence_penalty=st.floats(-2, 2), repetition_penalty=st.floats(0.01, 10), min_tokens=st.just(0),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=3),
    stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=4), ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20), skip_special_tokens=st.booleans(),
    include_stop_str_in_output=st.booleans())


@st.composite
def plans(draw: st.DrawFn) -> StepPlan:
    n = draw(st.integers(0, 6))
    num_new_blocks = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    new_requests = [NewRequest(draw(st.integers(0, 2**62)), draw(st.integers(0, 255)),
                               draw(st.integers(1, 20).flatmap(int32_arrays)), draw(st.integers(1, 20)),
                               draw(params_strategy)) for _ in range(draw(st.integers(0, 3)))]
    meta = None
    if draw(st.booleans()):
        loads, saves = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        meta = KVCopyMeta(draw(int32_arrays(loads)), draw(int32_arrays(loads)), draw(int32_arrays(saves)),
                          draw(int32_arrays(saves)))
    num_freed = draw(st.integers(0, 4))
    return StepPlan(
        step=draw(st.integers(0, 2**62)), new_requests=new_requests, rows=draw(int32_arrays(n)),
        num_computed_tokens=draw(int32_arrays(n)), num_scheduled_tokens=draw(int32_arrays(n)),
        sample=np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), np.bool_),
        num_new_blocks=np.array(num_new_blocks, np.int32), new_block_ids=draw(int32_arrays(sum(num_new_blocks))),
        freed_rows=draw(int32_arrays(num_freed)), freed_num_tokens=draw(int32_arrays(num_freed)), connector_meta=meta)


def assert_plans_equal(a: StepPlan, b: StepPlan) -> None:
    assert a.step == b.step
    for name in ("rows", "num_computed_tokens", "num_scheduled_tokens", "sample", "num_new_blocks",
                 "new_block_ids", "freed_rows", "freed_num_tokens"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert len(a.new_requests) == len(b.new_requests)
    for x, y in zip(a.new_requests, b.new_requests):
        assert (x.req_id, x.row, x.num_prompt_tokens, x.params) == (y.req_id, y.row, y.num_prompt_tokens, y.params)
        assert np.array_equal(x.token_ids, y.token_ids) and y.token_ids.dtype == np.int32
    assert (a.connector_meta is None) == (b.connector_meta is None)
    if a.connector_meta is not None:
        for name in ("load_host_slots", "load_block_ids", "save_block_ids", "save_host_slots"):
            assert np.array_equal(getattr(a.connector_meta, name), getattr(b.connector_meta, name))


def joined(parts: list[bytes]) -> memoryview:
    return memoryview(b"".join(parts))


@settings(max_examples=60, deadline=None)
@given(plans())
def test_plan_round_trips(plan: StepPlan) -> None:
    assert_plans_equal(msg.decode_plan(joined(msg.encode_plan(plan))), plan)


def test_a_plan_whose_freed_rows_lack_their_token_counts_is_refused() -> None:
    plan = StepPlan(step=1, new_requests=[], rows=np.zeros(0, np.int32), num_computed_tokens=np.zeros(0, np.int32),
                    num_scheduled_tokens=np.zeros(0, np.int32), sample=np.zeros(0, np.bool_),
                    num_new_blocks=np.zeros(0, np.int32), new_block_ids=np.zeros(0, np.int32),
                    freed_rows=np.array([3], np.int32))
    with pytest.raises(ValueError, match="plan 1 frees 1 rows but gives 0 token counts"):
        msg.encode_plan(plan)


@settings(max_examples=60, deadline=None)
@given(params_strategy)
def test_sampling_params_round_trip(params: SamplingParams) -> None:
    assert msg.decode_params(msg.encode_params(params)) == params


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**62), st.text(max_size=40) | st.lists(st.integers(-(2**40), 2**40), max_size=20),
       params_strategy, st.lists(st.integers(0, 2**31 - 1), max_size=20))
def test_generate_round_trips(req_id: int, prompt: str | list[int], params: SamplingParams, outputs: list[int]) -> None:
    decoded = msg.decode_generate(joined(msg.encode_generate(req_id, prompt, params)))
    assert (decoded.req_id, decoded.prompt, decoded.params, decoded.output_token_ids) == (req_id, prompt, params, [])
    resumed = msg.decode_generate(joined(msg.encode_generate(req_id, prompt, params, outputs)))
    assert (resumed.prompt, resumed.output_token_ids) == (prompt, outputs)


def test_new_request_round_trips_with_and_without_delivered_outputs() -> None:
    prompt = np.array([5, 6, 7], np.int32)
    new = msg.decode_new_request(joined(msg.encode_new_request(3, prompt, SamplingParams(seed=4))))
    assert new.req_id == 3 and new.prompt_ids.tolist() == [5, 6, 7] and new.output_ids.tolist() == []
    assert new.params == SamplingParams(seed=4)
    resumed = msg.decode_new_request(joined(msg.encode_new_request(3, prompt, msg.encode_params(SamplingParams()),
                                                                   np.array([9, 8], np.int32))))
    assert resumed.prompt_ids.tolist() == [5, 6, 7] and resumed.output_ids.tolist() == [9, 8]


def test_manifest_event_and_reject_round_trip() -> None:
    manifest = msg.Manifest(7, np.array([3, 9], np.int64), np.array([1, 0], np.int32),
                            [(3, FinishReason.LENGTH), (11, FinishReason.STOP)], slot=5)
    decoded = msg.decode_manifest(msg.encode_manifest(manifest))
    assert decoded.step == 7 and decoded.finished == manifest.finished
    assert decoded.slot == 5
    assert np.array_equal(decoded.req_ids, manifest.req_ids) and np.array_equal(decoded.output_index, [1, 0])

    events = [
        OutputEvent(5, "héllo ✓", np.array([4, 5], np.int32), finish_reason="abort",
                    prompt_token_ids=np.array([1, 2, 3], np.int32),
                    logprobs=np.array([[-0.5, -1.0, -2.0], [-0.1, -0.2, -3.0]], np.float32),
                    logprob_token_ids=np.array([[4, 4, 7], [5, 5, 8]], np.int32)),
        OutputEvent(6, "", np.zeros(0, np.int32)),
        OutputEvent(7, "", np.zeros(0, np.int32), error_code="prompt_too_long", error_message="prompt has 9 tokens"),
        OutputEvent(8, " x", np.array([9], np.int32), finish_reason="stop",
                    logprobs=np.array([[-0.25]], np.float32), logprob_token_ids=np.array([[9]], np.int32)),
        OutputEvent(9, "ab", np.array([3], np.int32), finish_reason="stop", stop_reason="ç\n"),
        OutputEvent(10, "", np.array([0], np.int32), finish_reason="stop", stop_reason=0),
    ]
    back = decode_events(encode_events(events))
    assert len(back) == len(events)
    for got, sent in zip(back, events):
        for name in ("req_id", "text", "finish_reason", "error_code", "error_message", "error_field", "stop_reason"):
            assert getattr(got, name) == getattr(sent, name), name
        for name in ("token_ids", "prompt_token_ids", "logprobs", "logprob_token_ids"):
            x, y = getattr(got, name), getattr(sent, name)
            assert (x is None) == (y is None) and (x is None or np.array_equal(x, y)), name
    assert decode_events(encode_events([])) == []

    rejection = msg.Rejection(8, "prompt_too_long", "", "prompt has 9 tokens")
    assert msg.decode_reject(msg.encode_reject(rejection)) == rejection


def test_frames_reject_a_truncated_record() -> None:
    record = joined(msg.frames(b"abcdefghij", b"xy"))
    assert [bytes(m) for m in msg.split_frames(record)] == [b"abcdefghij", b"xy"]
    with pytest.raises(ValueError, match="overruns"):
        msg.split_frames(record[:16])
