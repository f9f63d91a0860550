"""A tokenizer worker process: text to token ids in batches, prompt checks, on to the scheduler.

Each worker reads its own ring from the daemon and writes its own ring to the scheduler. A
request resumed after a stage restart comes as prompt ids plus the outputs it already delivered,
which go on untouched. A prompt the model cannot serve (empty, ids outside the vocabulary, too long) goes on as a
rejection, which reaches the daemon as an error event through the scheduler and detokenizer.
"""
from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from stages import messages as msg
from stages.process import StageContext, run_stage
from stages.tokenizer.encoding import PromptEncoder
from stages.tokenizer.prompt_check import check_prompt

MAX_BATCH = 64  # requests encoded in one encode_batch call


def main(spec_json: str) -> None:
    run_stage(spec_json, serve)


def serve(ctx: StageContext, tokenizer: Tokenizer | None = None) -> None:
    """Serves until stopped; `tokenizer` is the model's own unless one is given (a test double)."""
    encoder = PromptEncoder(tokenizer or Tokenizer.from_file(str(ctx.config.tokenizer_path)))
    inbox, outbox = ctx.reader("generate{i}"), ctx.writer("tokenized{i}")
    limits = ctx.wait_limits()
    tokenize_range = ctx.range("tokenize")
    ctx.ready()
    while True:
        ctx.tick()
        record = ctx.read_input(inbox)
        if record is None:
            continue
        batch = [msg.decode_generate(record.payload)]
        while len(batch) < MAX_BATCH and (record := inbox.try_read()) is not None:
            batch.append(msg.decode_generate(record.payload))
        texts = [g.prompt for g in batch if isinstance(g.prompt, str)]
        with tokenize_range:
            encoded = iter(encoder.encode_batch(texts))
        for request in batch:
            token_ids = next(encoded) if isinstance(request.prompt, str) else request.prompt
            outputs = request.output_token_ids
            problem = check_prompt(token_ids, limits.vocab_size, limits.max_model_len, num_output_tokens=len(outputs))
            if problem is not None:
                rejection = msg.Rejection(request.req_id, problem.code, problem.field, problem.message)
                ctx.write(outbox, msg.Kind.REJECT, msg.encode_reject(rejection))
            else:
                ctx.write(outbox, msg.Kind.NEW_REQUEST, *msg.encode_new_request(
                    request.req_id, np.array(token_ids, np.int32), request.params, np.array(outputs, np.int32)))
