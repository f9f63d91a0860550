"""A mixture of experts served by a live daemon: greedy tokens through the OpenAI HTTP API equal
transformers' on the same checkpoint."""
from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from live_daemon import REAL_BACKEND, serving

from pipeline.models.tiny_model import make_tiny_model

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not REAL_BACKEND, reason="starts `pipeline start --port` itself")]
NUM_NEW = 12
PROMPTS = ([5, 6, 7, 8, 9, 10], list(range(40, 140, 3)))


def hf_greedy(model_dir: Path, prompt: list[int]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NUM_NEW):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_qwen2_moe_over_http_equals_transformers(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = make_tiny_model(tmp_path_factory.mktemp("daemon-qwen2-moe"), "qwen2_moe", seed=41)
    with serving(model, ["--port", "0", "--served-model-name", "moe"]) as daemon:
        from pipeline.client import Client

        with Client(daemon.socket_path) as client:
            url = client.health().http_url
        sdk = openai.OpenAI(api_key="none", base_url=f"{url}/v1", max_retries=0)
        for prompt in PROMPTS:
            # A stream's chunks carry their token ids with return_token_ids.
            chunks = sdk.completions.create(model="moe", prompt=prompt, max_tokens=NUM_NEW, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            got = [t for chunk in chunks for choice in chunk.choices for t in choice.model_extra["token_ids"]]
            assert got == hf_greedy(model, prompt)
