"""The stage processes with a fault to inject, for the poison-guard test: a tokenizer worker dies
on any text prompt containing POISON_PROMPT, every time it sees one, as a stage crashed by one
request would. A TEST DOUBLE: the product has no such switch."""
from __future__ import annotations

from tokenizers import Encoding, Tokenizer

from pipeline.engine.multiprocess import StageBackend
from stages.contracts.topology import Stage
from stages.process import StageContext, run_stage
from stages.tokenizer import stage as tokenizer_stage

POISON_PROMPT = "<<poison the tokenizer>>"


class PoisonedTokenizer:
    """The model's tokenizer, except that a batch holding POISON_PROMPT raises."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[Encoding]:
        if any(POISON_PROMPT in text for text in texts):
            raise RuntimeError("a poisoned prompt")
        return self._tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)


def main(spec_json: str) -> None:
    """The tokenizer worker's process body (launched by module name, as every stage's)."""
    run_stage(spec_json, serve)


def serve(ctx: StageContext) -> None:
    tokenizer_stage.serve(ctx, PoisonedTokenizer(Tokenizer.from_file(str(ctx.config.tokenizer_path))))


class PoisonedStageBackend(StageBackend):
    def stage_table(self) -> list[Stage]:
        return [Stage(stage.name, __name__, stage.group) if stage.name.startswith("tokenizer") else stage
                for stage in super().stage_table()]
