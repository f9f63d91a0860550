"""Every process and every link between them: who writes a link, who reads it, how big it is.

The daemon creates the links and spawns the stages from these tables; each stage asks its
context for its own ends by link name (`ctx.reader("plan")`), so no index or ring name is
written anywhere else. A name with `{i}` stands for one link (or stage) per tokenizer worker i;
one with `{r}` for one stage per tensor-parallel rank r >= 1 of this machine (rank 0 is `runner`:
it alone writes `done` and the mailbox; every rank reads `plan`).

    daemon -generate{i}-> tokenizer{i} -tokenized{i}-> scheduler -plan-> runner -done-> scheduler
    daemon -abort-> scheduler      scheduler -manifest-> detokenizer -events-> daemon
    detokenizer -stop_strings-> scheduler
    runner -mailbox (each step's sampled tokens)-> scheduler, detokenizer
    scheduler -plan-> runner{r} (tensor-parallel ranks 1..N-1 on this machine)

Stages of one group restart together. The frontend group (the tokenizer workers and the
detokenizer) restarts alone, on fresh links, while the engine group (the scheduler and the
runner ranks, which share the step protocol and hold the KV cache and its prefix index) runs on;
a crash in any other group restarts every stage. A tensor-parallel rank cannot rejoin a group
whose other ranks run on, so the death of one runner rank restarts every rank with the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

DAEMON = "daemon"
PER_TOKENIZER = "{i}"
PER_RANK = "{r}"
RUNNER = "runner"
ENGINE = "engine"
FRONTEND = "frontend"
RESTARTS_ALONE = (FRONTEND,)  # groups whose crash restarts that group only


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    module: str  # the module whose `main(spec_json)` is the stage's process body
    group: str = ENGINE  # the stages that restart together (see the module's doc)


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    writer: str
    readers: tuple[str, ...]
    capacity_bytes: int
    family: str = ""  # the table entry it comes from ("generate{i}" for "generate0"); itself if none

    def reader_index(self, stage: str) -> int:
        return self.readers.index(stage)


STAGES = (
    Stage(RUNNER, "stages.gpu_runner.stage", ENGINE),
    Stage(RUNNER + PER_RANK, "stages.gpu_runner.stage", ENGINE),
    Stage("scheduler", "stages.scheduler.stage", ENGINE),
    Stage("detokenizer", "stages.detokenizer.stage", FRONTEND),
    Stage("tokenizer{i}", "stages.tokenizer.stage", FRONTEND),
)

REQUEST_BYTES = 4 << 20
STEP_BYTES = 16 << 20  # a plan or manifest carries every admitted request's whole prompt
EVENT_BYTES = 8 << 20
CONTROL_BYTES = 1 << 16

LINKS = (
    Link("generate{i}", DAEMON, ("tokenizer{i}",), REQUEST_BYTES),
    Link("tokenized{i}", "tokenizer{i}", ("scheduler",), REQUEST_BYTES),
    Link("abort", DAEMON, ("scheduler",), CONTROL_BYTES),
    Link("plan", "scheduler", (RUNNER, RUNNER + PER_RANK), STEP_BYTES),
    Link("done", "runner", ("scheduler",), CONTROL_BYTES),
    Link("manifest", "scheduler", ("detokenizer",), STEP_BYTES),
    Link("stop_strings", "detokenizer", ("scheduler",), CONTROL_BYTES),
    Link("events", "detokenizer", (DAEMON,), EVENT_BYTES),
)

MAILBOX_WRITER = "runner"
MAILBOX_READERS = ("scheduler", "detokenizer")  # a reader's index is its place here


def _expand(name: str, num_tokenizers: int, num_ranks: int) -> list[str]:
    if PER_RANK in name:
        return [name.replace(PER_RANK, str(r)) for r in range(1, num_ranks)]
    if PER_TOKENIZER not in name:
        return [name]
    return [name.replace(PER_TOKENIZER, str(i)) for i in range(num_tokenizers)]


def stages(num_tokenizers: int, num_ranks: int = 1) -> list[Stage]:
    """Every stage process in spawn order (a stage's index is its place here); `num_ranks`:
    the tensor-parallel runner ranks on this machine."""
    return [Stage(name, stage.module, stage.group) for stage in STAGES
            for name in _expand(stage.name, num_tokenizers, num_ranks)]


def restart_group(stage: str, num_tokenizers: int, num_ranks: int = 1) -> list[str]:
    """The stages that restart when `stage` dies: its group if that restarts alone, else all."""
    table = stages(num_tokenizers, num_ranks)
    group = next((s.group for s in table if s.name == stage), None)
    if group not in RESTARTS_ALONE:
        return [s.name for s in table]
    return [s.name for s in table if s.group == group]


def touches(link: Link, stage_names: list[str]) -> bool:
    """Whether one of `stage_names` writes or reads `link` (such a link is made afresh when they restart)."""
    return link.writer in stage_names or any(reader in stage_names for reader in link.readers)


def segment_link(link_name: str, generation: int) -> str:
    """The segment name part of `link_name` in frontend generation `generation` (0: the first)."""
    return link_name if generation == 0 else f"{link_name}-g{generation}"


def runner_rank(name: str) -> int:
    """The tensor-parallel rank (on this machine) of runner stage `name`: 0 for `runner`."""
    suffix = name.removeprefix(RUNNER)
    return int(suffix) if suffix else 0


def links(num_tokenizers: int, num_ranks: int = 1) -> list[Link]:
    """Every link with its `{i}` spelled out: per tokenizer worker i, writer and readers follow;
    readers `{r}` become one per runner rank 1..num_ranks-1."""
    expanded = []
    for link in LINKS:
        if PER_TOKENIZER not in link.name:
            readers = tuple(r for reader in link.readers for r in _expand(reader, num_tokenizers, num_ranks))
            expanded.append(Link(link.name, link.writer, readers, link.capacity_bytes, link.name))
            continue
        for i in range(num_tokenizers):
            def spell(name: str) -> str:
                return name.replace(PER_TOKENIZER, str(i))

            expanded.append(Link(spell(link.name), spell(link.writer), tuple(spell(r) for r in link.readers),
                                 link.capacity_bytes, link.name))
    return expanded
