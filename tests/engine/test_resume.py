"""A request resumed with the outputs it had delivered (as the daemon resumes one after a stage
restart) goes on exactly as the uninterrupted run: tokens, text, finish and stop reason."""
from __future__ import annotations

from pathlib import Path

import pytest
from device_choice import engine_device

from pipeline import LLM, SamplingParams
from pipeline.engine.loop import Engine
from stages.contracts.outputs import OutputEvent

pytestmark = pytest.mark.timeout(60)

MAX_TOKENS = 24


def run(engine: Engine, requests: dict[int, tuple[list[int], SamplingParams, list[int]]]) -> dict[int, list[OutputEvent]]:
    """Each request's events; a request is (prompt ids, params, outputs it already delivered)."""
    events: dict[int, list[OutputEvent]] = {req_id: [] for req_id in requests}
    for req_id, (prompt, params, delivered) in requests.items():
        engine.add_request(req_id, prompt, params, delivered)
    while engine.busy:
        for event in engine.step():
            events[event.req_id].append(event)
    return events


def token_ids(events: list[OutputEvent]) -> list[int]:
    return [t for event in events for t in event.token_ids.tolist()]


def test_resumed_requests_continue_as_the_uninterrupted_run(tiny_llama: Path) -> None:
    device = engine_device()
    llm = LLM(tiny_llama, device=device, max_model_len=256, num_kv_blocks=128, block_size=4,
              **({"dtype": "float32"} if device == "cpu" else {}))  # exact across batch shapes (small_engine.py)
    prompt = llm.tokenize(0, "the quick brown fox")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    probe = token_ids(run(llm.engine, {0: (prompt, greedy, [])})[0])
    probe_text = llm.tokenizer.decode(probe)
    params = [
        greedy,
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=50, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=9, presence_penalty=0.8, frequency_penalty=0.5,
                       repetition_penalty=1.3, ignore_eos=True),
        # min_tokens bars the stop token (greedy's 7th output) until output 12, counted from the
        # first output, not from the resume.
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, min_tokens=12, stop_token_ids=[probe[6]]),
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[probe_text[-12:][:3]]),
    ]
    whole = run(llm.engine, {i: (prompt, p, []) for i, p in enumerate(params)})
    assert [e[-1].finish_reason for e in whole.values()] == ["length", "length", "length", "stop", "stop"]
    assert len(token_ids(whole[1])) == MAX_TOKENS and token_ids(whole[1]) != token_ids(whole[0])
    assert len(token_ids(whole[3])) > 12 and whole[3][-1].stop_reason == probe[6]
    for delivered in (1, 7, 12):
        resumed = run(llm.engine, {100 + i: (prompt, p, token_ids(whole[i][:delivered])) for i, p in enumerate(params)})
        for i, events in enumerate(whole.values()):
            again = resumed[100 + i]
            assert token_ids(again) == token_ids(events[delivered:]), (i, delivered)
            assert "".join(e.text for e in again) == "".join(e.text for e in events[delivered:]), (i, delivered)
            assert (again[-1].finish_reason, again[-1].stop_reason) == (events[-1].finish_reason,
                                                                       events[-1].stop_reason)
    assert llm.scheduler.stats().kv_blocks_free == 128
