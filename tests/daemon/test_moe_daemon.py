"""Mixtures of experts served by a live daemon: greedy tokens streamed through the OpenAI HTTP API
equal transformers' on the same checkpoint, for each family (one daemon each)."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from hf_reference import skip_where_transformers_ignores_the_swiglu_limit
from live_daemon import REAL_BACKEND, serving

from pipeline.models.tiny_model import make_tiny_model

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not REAL_BACKEND, reason="starts `pipeline start --port` itself")]
NUM_NEW = 12
PROMPTS = ([5, 6, 7, 8, 9, 10], list(range(40, 140, 3)))


def hf_greedy(model_dir: Path) -> list[list[int]]:
    """transformers' greedy tokens for each of PROMPTS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    skip_where_transformers_ignores_the_swiglu_limit(model)
    tokens = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(NUM_NEW):
                ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        tokens.append(ids[0, len(prompt):].tolist())
    return tokens


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_a_mixture_over_http_equals_transformers(tmp_path_factory: pytest.TempPathFactory, arch: str) -> None:
    model = make_tiny_model(tmp_path_factory.mktemp(f"daemon-{arch}"), arch, seed=41)
    with serving(model, ["--port", "0", "--served-model-name", "moe"]) as daemon:
        from pipeline.client import Client

        with Client(daemon.socket_path) as client:
            url = client.health().http_url
        sdk = openai.OpenAI(api_key="none", base_url=f"{url}/v1", max_retries=0)
        for prompt, expected in zip(PROMPTS, hf_greedy(model)):
            # A stream's chunks carry their token ids with return_token_ids.
            chunks = sdk.completions.create(model="moe", prompt=prompt, max_tokens=NUM_NEW, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            got = [t for chunk in chunks for choice in chunk.choices for t in choice.model_extra["token_ids"]]
            assert got == expected
