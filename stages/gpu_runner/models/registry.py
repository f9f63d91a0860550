"""Which model class serves which checkpoint architecture."""
from __future__ import annotations

from stages.gpu_runner.models.base import CausalLM
from stages.gpu_runner.models.config import GEMMA3_FAMILY, GPT_OSS, LLAMA_FAMILY, MOE_FAMILY, ModelConfig


def model_class(config: ModelConfig) -> type[CausalLM]:
    if config.architecture in LLAMA_FAMILY:
        from stages.gpu_runner.models.llama import LlamaForCausalLM
        return LlamaForCausalLM
    if config.architecture in GEMMA3_FAMILY:
        from stages.gpu_runner.models.gemma3 import Gemma3ForCausalLM
        return Gemma3ForCausalLM
    if config.architecture in MOE_FAMILY:
        from stages.gpu_runner.models.moe import MoEForCausalLM
        return MoEForCausalLM
    if config.architecture == GPT_OSS:
        from stages.gpu_runner.models.gpt_oss import GptOssForCausalLM
        return GptOssForCausalLM
    raise ValueError(f"no model class serves architecture {config.architecture!r}")
