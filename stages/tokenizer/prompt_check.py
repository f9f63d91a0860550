"""Whether a tokenized prompt can be served: non-empty, in the vocabulary, short enough to generate."""
from __future__ import annotations

from dataclasses import dataclass

from stages.contracts.errors import ErrorCode


@dataclass(slots=True)
class PromptProblem:
    code: str  # an ErrorCode value
    field: str  # "" when the problem is not one request field's
    message: str


def check_prompt(token_ids: list[int], vocab_size: int, max_model_len: int, label: str = "prompt",
                 num_output_tokens: int = 0) -> PromptProblem | None:
    """None if the prompt is servable, else what is wrong (the message starts with `label`).

    `num_output_tokens` are outputs a resumed request already has: they count toward the length
    (they were sampled by the model, so they are in its vocabulary)."""
    if not token_ids:
        return PromptProblem(ErrorCode.INVALID_PARAMS.value, "prompt", f"{label} is empty")
    # Length first: it is O(1), and a prompt too long to serve need not be scanned.
    num_tokens = len(token_ids) + num_output_tokens
    if num_tokens >= max_model_len:
        outputs = f" and {num_output_tokens} outputs" if num_output_tokens else ""
        return PromptProblem(ErrorCode.PROMPT_TOO_LONG.value, "",
                             f"{label} has {len(token_ids)} tokens{outputs}; max_model_len {max_model_len} "
                             f"allows at most {max_model_len - 1} so one token can be generated")
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:  # in C; the list below only when needed
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        return PromptProblem(ErrorCode.INVALID_PARAMS.value, "prompt",
                             f"{label} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return None
