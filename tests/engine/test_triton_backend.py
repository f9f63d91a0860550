"""The offline engine with the triton attention backend, its kernels under the Triton interpreter
on the CPU: the same greedy tokens as the torch backend, on the dynamic and the static decode path."""
from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import LLM, SamplingParams
from stages.contracts.config import EngineConfig
from stages.gpu_runner.runner import ModelRunner

pytest.importorskip("triton", minversion="3.7")  # the interpreter runs the kernels (loading.py)
pytestmark = pytest.mark.timeout(120)

OPTIONS = dict(device="cpu", max_model_len=64, num_kv_blocks=16, block_size=16, max_num_seqs=2,
               max_num_batched_tokens=24, async_scheduling=True)


def greedy_tokens(model: Path, attention_backend: str, static_decode: bool) -> list[list[int]]:
    config = EngineConfig(model=str(model), attention_backend=attention_backend, **OPTIONS)
    runner = ModelRunner(config, static_decode=static_decode)
    assert runner.attention_backend.name == attention_backend
    llm = LLM(model=model, runner=runner, attention_backend=attention_backend, **OPTIONS)
    # A prompt longer than the token budget (chunked: a mixed step) and a short one.
    prompts = [list(range(40, 70)), [5, 9, 11]]
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))]


def test_triton_backend_gives_the_torch_backends_greedy_tokens(tiny_llama: Path) -> None:
    expected = greedy_tokens(tiny_llama, "torch", static_decode=False)
    assert [len(t) for t in expected] == [4, 4]
    assert greedy_tokens(tiny_llama, "triton", static_decode=False) == expected
    assert greedy_tokens(tiny_llama, "triton", static_decode=True) == expected


def test_triton_backend_serves_gemma3_local_and_global_layers(tmp_path: Path) -> None:
    """Gemma 3's sandwich norms, (1 + w) q/k norms and windowed local layers in the kernels: the
    tiny model's window of 16 tokens is crossed by the 30-token prompt and its decodes."""
    from pipeline.models.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "gemma3", "gemma3", seed=15)
    expected = greedy_tokens(model, "torch", static_decode=False)
    assert greedy_tokens(model, "triton", static_decode=False) == expected
    with pytest.raises(ValueError, match="static_decode is not supported for a model with local and global layers"):
        greedy_tokens(model, "triton", static_decode=True)


def test_triton_backend_verifies_drafts_of_lagged_rows(tiny_llama: Path) -> None:
    """Speculative steps in the kernels: rows verifying drafts are prefill rows whose context the
    device moves back by their last step's rejected drafts (a draft model's decoding through them
    is checked on CUDA, tests/gpu_runner/test_runner_cuda.py)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    prompts = [[11, 12, 13, 14] * 4, [5, 9, 11]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model=tiny_llama, **OPTIONS).generate(prompts, params)]
    config = EngineConfig(model=str(tiny_llama), attention_backend="triton", speculative_config=spec, **OPTIONS)
    llm = LLM(model=tiny_llama, runner=ModelRunner(config), attention_backend="triton", speculative_config=spec,
              **OPTIONS)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.scheduler.stats().speculative.num_draft_tokens > 0
