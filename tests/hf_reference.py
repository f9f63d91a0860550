"""What a test needs to know of the installed transformers before it takes it as the reference."""
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
