"""Soak: a live daemon under random requests with random parameters and random client aborts.

Every request is drawn from a seeded plan: greedy, seeded or unseeded sampling; max_tokens, stop
strings and stop token ids (picked from the model's own output, so they do fire), logprobs,
ignore_eos; streamed or not; and ended early in one of four ways (leave a stream after some
deltas, abort it by message, drop the connection right after Accepted, cancel a generate after
a short time) or not at all. K workers send them at once. Then: every greedy or seeded request
that finished equals the offline engine's output for the same prompt and params, token for
token (and its text); every stream, finished or cut short, delivered a prefix of that output
with no token lost or repeated (for unseeded sampling: as many tokens as the daemon counted);
seeded requests repeat exactly; the daemon ends idle with every KV block free, the same stage
processes and bounded resident memory.

Short by default (CI); `make soak` runs the long one through the environment:
PIPELINE_SOAK_REQUESTS (300), PIPELINE_SOAK_CONCURRENCY (32), PIPELINE_SOAK_SEED (0),
PIPELINE_SOAK_TIMEOUT_S (120).
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import pytest
from device_choice import engine_device, engine_dtype
from live_daemon import ENGINE_OPTIONS, LiveDaemon, memory_kib, wait_idle

from pipeline import LLM, SamplingParams
from pipeline.client import AsyncClient, AsyncConnection, Completion, make_generate
from pipeline.engine.llm import RequestOutput
from pipeline.errors import RequestAborted
from pipeline.protocol import Accepted, Done, Error, HealthReply
from pipeline.models.tiny_model import corpus


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a positive integer, got {text!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


NUM_REQUESTS = _env_int("PIPELINE_SOAK_REQUESTS", 300)
CONCURRENCY = _env_int("PIPELINE_SOAK_CONCURRENCY", 32)
SEED = int(os.environ.get("PIPELINE_SOAK_SEED", "0"))
TIMEOUT_S = _env_int("PIPELINE_SOAK_TIMEOUT_S", 120)

pytestmark = [pytest.mark.soak, pytest.mark.timeout(TIMEOUT_S)]

NUM_TEXT_PROMPTS = 24
NUM_TOKEN_PROMPTS = 24
NUM_SHARED_PREFIXES = 4  # token prompts share these, so prefix caching serves concurrent requests
MAX_TOKENS = 40
NUM_GREEDY_KEYS = 160  # distinct greedy (prompt, params): many repeats, a bounded offline reference
NUM_SEEDED_KEYS = 16  # few, so every seeded key repeats
REQUEST_TIMEOUT_S = 60.0  # a request that takes this long hangs: the soak fails rather than waits
IDLE_TIMEOUT_S = 10.0
LOGPROB_TOLERANCE = 1e-3  # batches of different shapes round fp32 differently
# Resident memory also counts the pages of the shared-memory rings, which a process touches for
# the first time as the ring cursors advance through them: up to ~100 MiB over all processes,
# paid once. Private memory (RssAnon: the heaps) is what a leak would grow. Generous bounds for
# the daemon and its stages together: a leak of a few KB per request over the long run's 10,000
# requests would pass the private one, one that grows with every token would not.
MAX_RSS_GROWTH_MIB = 192.0
MAX_PRIVATE_GROWTH_MIB = 64.0


class Kind(Enum):
    GREEDY = "greedy"
    SEEDED = "seeded"
    SAMPLED = "sampled"  # unseeded: only the stream's integrity can be checked


class Ending(Enum):
    NONE = "none"  # runs to its end
    CLOSE_STREAM = "close_stream"  # leave the stream after `cut_after` deltas
    ABORT_MESSAGE = "abort_message"  # `AsyncClient.abort` after `cut_after` deltas
    DISCONNECT = "disconnect"  # drop the connection after `cut_after - 1` replies
    CANCEL = "cancel"  # a generate cancelled after `cancel_after_s`


@dataclass(slots=True)
class SoakRequest:
    index: int
    prompt: str | list[int]
    params: SamplingParams
    kind: Kind
    stream: bool
    ending: Ending
    key: int | None = None  # index of its offline reference (greedy and seeded)
    cut_after: int = 0
    cancel_after_s: float = 0.0


@dataclass(slots=True)
class Outcome:
    request: SoakRequest
    completion: Completion | None = None  # None when it ended early
    streamed_token_ids: list[int] = field(default_factory=list)
    streamed_text: str = ""
    error: str | None = None  # anything the request's ending does not explain


# --- the plan ---


def make_prompts(rng: random.Random, vocab_size: int) -> list[str | list[int]]:
    texts = [f"{line} {i}" for i, line in enumerate(corpus(SEED + 1, NUM_TEXT_PROMPTS))]
    prefixes = [[rng.randrange(2, vocab_size) for _ in range(rng.randint(16, 48))] for _ in range(NUM_SHARED_PREFIXES)]
    token_prompts = [rng.choice(prefixes) + [rng.randrange(2, vocab_size) for _ in range(rng.randint(1, 24))]
                     for _ in range(NUM_TOKEN_PROMPTS)]
    return [*texts, *token_prompts]


def random_params(rng: random.Random, kind: Kind, free_run: RequestOutput) -> SamplingParams:
    """Params of `kind`; stop strings and stop ids come from the prompt's greedy output."""
    params = SamplingParams(max_tokens=rng.randint(1, MAX_TOKENS), ignore_eos=rng.random() < 0.5)
    if kind is Kind.GREEDY:
        params.temperature = 0.0
    else:
        params.temperature = rng.choice([0.6, 1.0])
        params.top_p = rng.choice([1.0, 0.9])
        params.top_k = rng.choice([0, 20])
        if kind is Kind.SEEDED:
            params.seed = rng.randrange(2**32)
    if rng.random() < 0.3 and len(free_run.text) > 4:
        start = rng.randrange(len(free_run.text) - 3)
        params.stop = [free_run.text[start:start + rng.randint(1, 3)]]
    if rng.random() < 0.25:
        params.stop_token_ids = [rng.choice(free_run.token_ids)]
    if rng.random() < 0.25:
        params.logprobs = rng.randint(0, 5)
    return params


def make_plan(rng: random.Random, prompts: Sequence[str | list[int]], free_runs: Sequence[RequestOutput]
              ) -> tuple[list[SoakRequest], list[tuple[str | list[int], SamplingParams]]]:
    """The requests, and the (prompt, params) each `key` names."""
    keys: list[tuple[str | list[int], SamplingParams]] = []
    pools: dict[Kind, list[int]] = {}
    for kind, size in ((Kind.GREEDY, NUM_GREEDY_KEYS), (Kind.SEEDED, NUM_SEEDED_KEYS)):
        pools[kind] = []
        for _ in range(size):
            p = rng.randrange(len(prompts))
            pools[kind].append(len(keys))
            keys.append((prompts[p], random_params(rng, kind, free_runs[p])))
    requests = []
    for index in range(NUM_REQUESTS):
        kind = rng.choices([Kind.GREEDY, Kind.SEEDED, Kind.SAMPLED], weights=[5, 3, 2])[0]
        if kind is Kind.SAMPLED:
            p = rng.randrange(len(prompts))
            key, prompt, params = None, prompts[p], random_params(rng, kind, free_runs[p])
        else:
            key = rng.choice(pools[kind])
            prompt, params = keys[key]
        stream = rng.random() < 0.5
        endings = [Ending.NONE, Ending.DISCONNECT, Ending.CLOSE_STREAM, Ending.ABORT_MESSAGE] if stream else \
            [Ending.NONE, Ending.DISCONNECT, Ending.CANCEL]
        weights = [14, 1, 3, 2] if stream else [16, 1, 3]
        ending = rng.choices(endings, weights=weights)[0]
        requests.append(SoakRequest(index, prompt, params, kind, stream, ending, key,
                                    cut_after=rng.randint(1, 6), cancel_after_s=rng.uniform(0.005, 0.3)))
    return requests, keys


# --- sending ---


async def run_request(client: AsyncClient, request: SoakRequest) -> Outcome:
    outcome = Outcome(request)
    try:
        await asyncio.wait_for(_send(client, request, outcome), REQUEST_TIMEOUT_S)
    except TimeoutError:
        outcome.error = f"no reply within {REQUEST_TIMEOUT_S} s"
    except Exception as exc:  # noqa: BLE001 - every failure is collected and reported together
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def _send(client: AsyncClient, request: SoakRequest, outcome: Outcome) -> None:
    if request.ending is Ending.DISCONNECT:
        # Gone after cut_after - 1 replies: with none read, the close may reach the daemon
        # together with the Generate; a non-streamed request has only Accepted before Done.
        num_replies = request.cut_after - 1 if request.stream else min(request.cut_after - 1, 1)
        connection = await AsyncConnection.open(client.socket_path)
        try:
            await connection.send(make_generate(request.prompt, request.params, request.stream))
            for number in range(num_replies):
                reply = await connection.receive()
                if number == 0 and not isinstance(reply, Accepted):
                    outcome.error = f"expected Accepted, got {reply!r}"
                if isinstance(reply, (Done, Error)):
                    break
        finally:
            connection.close()
        return
    if not request.stream:
        try:
            if request.ending is Ending.CANCEL:
                outcome.completion = await asyncio.wait_for(client.generate(request.prompt, request.params),
                                                            request.cancel_after_s)
            else:
                outcome.completion = await client.generate(request.prompt, request.params)
        except TimeoutError:
            if request.ending is not Ending.CANCEL:
                raise
        return
    stream = client.stream(request.prompt, request.params)
    num_deltas = 0
    cut = request.ending is Ending.NONE  # True once the ending has been applied
    try:
        async for delta in stream:
            outcome.streamed_token_ids += delta.token_ids
            outcome.streamed_text += delta.text
            num_deltas += 1
            if not cut and num_deltas >= request.cut_after:
                cut = True
                if request.ending is Ending.CLOSE_STREAM:
                    break
                assert stream.request_id is not None
                await client.abort(stream.request_id)  # False if it finished meanwhile
    except RequestAborted:
        if request.ending is not Ending.ABORT_MESSAGE:
            raise
    finally:
        stream.close()
    outcome.completion = stream.completion


async def run_all(socket_path: Path, requests: Sequence[SoakRequest], concurrency: int) -> list[Outcome]:
    client = AsyncClient(socket_path)
    queue: asyncio.Queue[SoakRequest] = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while not queue.empty():
            outcomes.append(await run_request(client, queue.get_nowait()))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return sorted(outcomes, key=lambda o: o.request.index)


# --- checks ---


def problems(outcome: Outcome, reference: RequestOutput | None) -> list[str]:
    """What is wrong with one request's outcome; empty when nothing is."""
    request, completion = outcome.request, outcome.completion
    where = f"request {request.index} ({request.kind.value}, {'stream' if request.stream else 'generate'}, " \
            f"ending {request.ending.value})"
    if outcome.error is not None:
        return [f"{where}: {outcome.error}"]
    found = []
    if completion is None:  # ended early: what it streamed is the start of the whole output
        if reference is not None and outcome.streamed_token_ids != reference.token_ids[:len(outcome.streamed_token_ids)]:
            found.append(f"{where}: streamed {outcome.streamed_token_ids}, not a prefix of {reference.token_ids}")
        if reference is not None and not reference.text.startswith(outcome.streamed_text):
            found.append(f"{where}: streamed text {outcome.streamed_text!r} is not a prefix of {reference.text!r}")
        return found
    tokens = completion.token_ids
    if completion.usage.completion_tokens != len(tokens):
        found.append(f"{where}: {len(tokens)} tokens delivered, the daemon counted {completion.usage.completion_tokens}")
    if request.stream and (outcome.streamed_token_ids != tokens or outcome.streamed_text != completion.text):
        found.append(f"{where}: the deltas do not add up to the completion")
    if len(tokens) > request.params.max_tokens or completion.finish_reason not in ("stop", "length"):
        found.append(f"{where}: {len(tokens)} tokens for max_tokens {request.params.max_tokens}, "
                     f"finish_reason {completion.finish_reason!r}")
    if request.params.logprobs is None:
        if completion.logprobs:
            found.append(f"{where}: logprobs that were not asked for")
    elif completion.logprobs is None or [lp.token_id for lp in completion.logprobs] != tokens or \
            any(len(lp.top_token_ids) != request.params.logprobs for lp in completion.logprobs):
        found.append(f"{where}: logprobs do not match the tokens or the number asked for")
    if reference is None:
        return found
    if (tokens, completion.text, completion.finish_reason) != (reference.token_ids, reference.text,
                                                                reference.finish_reason):
        found.append(f"{where}: daemon {tokens} {completion.text!r} ({completion.finish_reason}) != offline "
                     f"{reference.token_ids} {reference.text!r} ({reference.finish_reason})")
    elif completion.logprobs is not None and reference.logprobs is not None:
        for position, (got, expected) in enumerate(zip(completion.logprobs, reference.logprobs)):
            if abs(got.logprob - next(iter(expected.values()))) > LOGPROB_TOLERANCE:
                found.append(f"{where}: token {position} logprob {got.logprob} != offline {expected}")
                break
    return found


def stage_pids(health: HealthReply) -> dict[str, int]:
    pids = dict(getattr(health, "stage_pids", None) or {})
    for name, state in health.stages.items():
        match = re.search(r"\bpid (\d+)", state)
        if name not in pids and match:
            pids[name] = int(match.group(1))
    return pids


def snapshot(daemon: LiveDaemon) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """(pids, (resident, private) KiB) of the daemon and each stage."""
    async def health() -> HealthReply:
        return await AsyncClient(daemon.socket_path).health()

    reply = asyncio.run(health())
    assert reply.status == "ok", reply
    pids = {"daemon": daemon.process.pid, **stage_pids(reply)}
    assert len(pids) > 1, f"no stage pids in health(): {reply}"
    return pids, {name: memory_kib(pid) for name, pid in pids.items()}


# --- the test ---


@pytest.fixture(scope="module")
def offline(daemon_model: Path) -> LLM:
    """The offline engine with the live daemon's engine options."""
    options = dict(zip(ENGINE_OPTIONS[::2], ENGINE_OPTIONS[1::2]))
    return LLM(daemon_model, device=engine_device(), dtype=engine_dtype(engine_device()),
               max_model_len=int(options["--max-model-len"]),
               num_kv_blocks=int(options["--num-kv-blocks"]), block_size=int(options["--block-size"]))


def test_soak_random_requests_and_aborts(live_daemon: LiveDaemon, offline: LLM) -> None:
    rng = random.Random(SEED)
    prompts = make_prompts(rng, offline.vocab_size)
    free_runs = offline.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    requests, keys = make_plan(rng, prompts, free_runs)
    used = sorted({r.key for r in requests if r.key is not None})
    references = dict(zip(used, offline.generate([keys[k][0] for k in used], [keys[k][1] for k in used])))

    # Warm-up: a first slice of the plan, after which the processes have reached their working size.
    num_warmup = min(len(requests) // 5, 4 * CONCURRENCY)
    started_s = time.monotonic()
    outcomes = asyncio.run(run_all(live_daemon.socket_path, requests[:num_warmup], CONCURRENCY))
    wait_idle(live_daemon.socket_path, IDLE_TIMEOUT_S)
    pids_before, memory_before = snapshot(live_daemon)
    outcomes += asyncio.run(run_all(live_daemon.socket_path, requests[num_warmup:], CONCURRENCY))
    elapsed_s = time.monotonic() - started_s
    wait_idle(live_daemon.socket_path, IDLE_TIMEOUT_S)
    pids_after, memory_after = snapshot(live_daemon)

    found = [p for o in outcomes for p in problems(o, references.get(o.request.key))]
    assert not found, f"{len(found)} problems, the first ones:\n" + "\n".join(found[:20])

    finished = [o for o in outcomes if o.completion is not None]
    tally = Counter((o.request.kind.value, o.request.ending.value, o.completion is not None) for o in outcomes)
    by_key: dict[int, list[list[int]]] = defaultdict(list)
    for o in finished:
        if o.request.kind is Kind.SEEDED:
            by_key[o.request.key].append(o.completion.token_ids)  # type: ignore[union-attr]
    assert all(len({tuple(t) for t in outputs}) == 1 for outputs in by_key.values())
    assert sum(len(outputs) > 1 for outputs in by_key.values()) >= 2, "too few seeded repeats to compare"
    # The plan must have exercised what it claims to: early endings that cut requests short,
    # finished greedy streams, and stop strings and ids that fired.
    assert sum(o.completion is None for o in outcomes) >= NUM_REQUESTS // 20, tally
    assert any(o.request.kind is Kind.GREEDY and o.request.stream for o in finished), tally
    assert any(o.request.params.stop and o.completion.finish_reason == "stop" for o in finished)  # type: ignore[union-attr]

    assert pids_after == pids_before, "a stage was replaced during the soak"
    growth_kib, private_growth_kib = (sum(memory_after[n][i] for n in pids_before)
                                      - sum(memory_before[n][i] for n in pids_before) for i in (0, 1))
    per_process = ", ".join(f"{name} {memory_before[name][0] / 1024:.0f}->{memory_after[name][0] / 1024:.0f} "
                            f"(private {memory_before[name][1] / 1024:.0f}->{memory_after[name][1] / 1024:.0f})"
                            for name in pids_before)
    print(f"\nsoak: {NUM_REQUESTS} requests, {CONCURRENCY} concurrent, {elapsed_s:.1f} s; "
          f"{len(finished)} finished, {len(outcomes) - len(finished)} ended early; "
          f"{sum(len(o.completion.token_ids) for o in finished)} tokens delivered\n"  # type: ignore[union-attr]
          f"soak: memory growth after {num_warmup} warm-up requests, MiB: resident {growth_kib / 1024:+.1f}, "
          f"private {private_growth_kib / 1024:+.1f}; per process resident (private): {per_process}")
    assert private_growth_kib / 1024 <= MAX_PRIVATE_GROWTH_MIB
    assert growth_kib / 1024 <= MAX_RSS_GROWTH_MIB
