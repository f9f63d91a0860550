"""What a test needs of the installed transformers before it takes it as the reference, and its greedy decoding."""
from __future__ import annotations

import pytest


def skip_where_transformers_ignores_the_swiglu_limit(model: object) -> None:
    """gpt-oss clamps its SwiGLU at the checkpoint's swiglu_limit (the tiny models set 3.0, so the
    clamp is exercised); transformers before 5.2x fixed it at 7.0 whatever the config said, so its
    tokens are no reference for such a checkpoint. Skips, saying so, when `model` (a loaded
    transformers gpt-oss) holds a limit other than its config's."""
    import transformers

    config = model.config
    if getattr(config, "model_type", None) != "gpt_oss":
        return
    limits = {float(module.limit) for module in model.modules() if hasattr(module, "limit") and hasattr(module, "alpha")}
    if limits != {float(config.swiglu_limit)}:
        pytest.skip(f"transformers {transformers.__version__} clamps gpt-oss's SwiGLU at {sorted(limits)}, not at the "
                    f"checkpoint's swiglu_limit {config.swiglu_limit}: its tokens are no reference")


def greedy_with_top2(model: object, prompt: list[int], num_new: int, device: str = "cpu",
                     last_logits_only: bool = False) -> tuple[list[int], list[tuple[float, float]]]:
    """A loaded transformers model's greedy continuation of `prompt` with its own KV cache (argmax
    each step, EOS not stopping it): the tokens, and each step's two highest logits.
    `last_logits_only` computes the prompt's logits at its last position alone (a long prompt)."""
    import torch

    with torch.no_grad():
        first = {"logits_to_keep": 1} if last_logits_only else {}
        out = model(torch.tensor([prompt], device=device), use_cache=True, **first)
        tokens, tops = [], []
        for _ in range(num_new):
            top = out.logits[0, -1].float().topk(2)
            tokens.append(int(top.indices[0]))
            tops.append((float(top.values[0]), float(top.values[1])))
            out = model(torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, tops
