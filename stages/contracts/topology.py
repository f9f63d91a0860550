"""Every process and every link between them: who writes a link, who reads it, how big it is.

The daemon creates the links and spawns the stages from these tables; each stage asks its
context for its own ends by link name (`ctx.reader("plan")`), so no index or ring name is
written anywhere else. A name with `{i}` stands for one link (or stage) per tokenizer worker i.

    daemon -generate{i}-> tokenizer{i} -tokenized{i}-> scheduler -plan-> runner -done-> scheduler
    daemon -abort-> scheduler      scheduler -manifest-> detokenizer -events-> daemon
    detokenizer -stop_strings-> scheduler
    runner -mailbox (each step's sampled tokens)-> scheduler, detokenizer

Stages of one group restart together. The frontend group (the tokenizer workers and the
detokenizer) restarts alone, on fresh links, while the engine group (the scheduler and the
runner, which share the step protocol and hold the KV cache and its prefix index) runs on; a
crash in any other group restarts every stage.
"""
from __future__ import annotations

from dataclasses import dataclass

DAEMON = "daemon"
PER_TOKENIZER = "{i}"
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
    Stage("runner", "stages.gpu_runner.stage", ENGINE),
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
    Link("plan", "scheduler", ("runner",), STEP_BYTES),
    Link("done", "runner", ("scheduler",), CONTROL_BYTES),
    Link("manifest", "scheduler", ("detokenizer",), STEP_BYTES),
    Link("stop_strings", "detokenizer", ("scheduler",), CONTROL_BYTES),
    Link("events", "detokenizer", (DAEMON,), EVENT_BYTES),
)

MAILBOX_WRITER = "runner"
MAILBOX_READERS = ("scheduler", "detokenizer")  # a reader's index is its place here


def _expand(name: str, num_tokenizers: int) -> list[str]:
    if PER_TOKENIZER not in name:
        return [name]
    return [name.replace(PER_TOKENIZER, str(i)) for i in range(num_tokenizers)]


def stages(num_tokenizers: int) -> list[Stage]:
    """Every stage process in spawn order (a stage's index is its place here)."""
    return [Stage(name, stage.module, stage.group) for stage in STAGES
            for name in _expand(stage.name, num_tokenizers)]


def restart_group(stage: str, num_tokenizers: int) -> list[str]:
    """The stages that restart when `stage` dies: its group if that restarts alone, else all."""
    table = stages(num_tokenizers)
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


def links(num_tokenizers: int) -> list[Link]:
    """Every link with its `{i}` spelled out: per tokenizer worker i, writer and readers follow."""
    expanded = []
    for link in LINKS:
        if PER_TOKENIZER not in link.name:
            expanded.append(Link(link.name, link.writer, link.readers, link.capacity_bytes, link.name))
            continue
        for i in range(num_tokenizers):
            def spell(name: str) -> str:
                return name.replace(PER_TOKENIZER, str(i))

            expanded.append(Link(spell(link.name), spell(link.writer), tuple(spell(r) for r in link.readers),
                                 link.capacity_bytes, link.name))
    return expanded
