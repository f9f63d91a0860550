"""A multi-turn chat workload with shared system prompts (the router's test and benchmark):
conversations run side by side, each one turn after the other, each turn's prompt holding the
whole history so far (what a chat client sends).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = ("river stone lamp orbit maple quiet signal harbor copper meadow velvet glacier ember lantern "
         "thistle canyon marble willow falcon prism cobalt juniper tundra sparrow").split()


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words)).capitalize() + "."


def scrape_metric(url: str, name: str) -> float:
    """One series of a server's /metrics: `name` alone, with its labels as they print
    ('name{label="x"}'), or the first series of `name` when its labels are left out."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"no {name} in {url}/metrics")


def fleet_prefix_hit_tokens(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache hit tokens, prompt tokens) summed over the daemons at `urls`, from their own
    metrics: each one's hit rate times its prompt tokens (exact while nothing is preempted)."""
    hits = total = 0.0
    for url in urls:
        prompt_tokens = scrape_metric(url, "pipeline:prompt_tokens_total")
        hits += scrape_metric(url, "pipeline:prefix_cache_hit_rate") * prompt_tokens
        total += prompt_tokens
    return hits, total


@dataclass(slots=True)
class TurnResult:
    ttft_s: float
    latency_s: float
    num_tokens: int
    turn: int = 0  # its place in its conversation, from 0
    messages: list[dict] = field(default_factory=list)  # what it sent
    reply: str = ""


@dataclass(slots=True)
class WorkloadResult:
    turns: list[TurnResult] = field(default_factory=list)
    wall_s: float = 0.0


def conversations(num_conversations: int, num_system_prompts: int, seed: int) -> list[tuple[str, list[str]]]:
    """(system prompt, user messages) per conversation; conversation i uses system prompt i % S."""
    rng = random.Random(seed)
    systems = [f"System {seed}-{s}: " + sentence(rng, 6) for s in range(num_system_prompts)]
    return [(systems[i % num_system_prompts], [f"User {i}: " + sentence(rng, 60) for _ in range(8)])
            for i in range(num_conversations)]


async def run_workload(url: str, num_conversations: int = 9, num_turns: int = 4, num_system_prompts: int = 3,
                       max_tokens: int = 6, seed: int = 0) -> WorkloadResult:
    result = WorkloadResult()
    start = time.monotonic()

    async def converse(client: httpx.AsyncClient, system: str, users: list[str]) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(num_turns):
            messages.append({"role": "user", "content": users[turn]})
            sent = time.monotonic()
            first, text, num_tokens = None, "", 0
            async with client.stream("POST", f"{url}/v1/chat/completions", json={
                    "model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"turn {turn} failed: {response.status_code} {await response.aread()!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"turn {turn} failed: {chunk['error']}")
                    if chunk.get("usage"):
                        num_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk["choices"]:
                        content = choice["delta"].get("content") or ""
                        if content and first is None:
                            first = time.monotonic()
                        text += content
            done = time.monotonic()
            result.turns.append(TurnResult((first or done) - sent, done - sent, num_tokens, turn, list(messages), text))
            messages.append({"role": "assistant", "content": text})

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(converse(client, system, users)
                               for system, users in conversations(num_conversations, num_system_prompts, seed)))
    result.wall_s = time.monotonic() - start
    return result

