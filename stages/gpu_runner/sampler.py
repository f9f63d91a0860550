"""On-device sampling: logits in, one token per row out, no host synchronisation.

INTERFACE STUB: the signatures below are the contract the runner codes against.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling inputs for one step's sampled rows, already on the device."""

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_pos: np.ndarray,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt_tokens: np.ndarray,
        token_table: torch.Tensor,
        eos_token_ids: list[int],
        device: torch.device,
    ) -> "SamplingMetadata":
        """params[i] belongs to sampled row rows[i]; output_pos[i] is the index, among that
        request's outputs, of the token being sampled now (0 for the first);
        num_tokens[i] is how many of token_table[rows[i]] are known (prompt + outputs before
        this one); num_prompt_tokens[i] how many of those are prompt. token_table is the
        runner's device table [max_num_seqs, max_model_len] int32, read for penalties."""
        raise NotImplementedError


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int32 [n]
    logprobs: torch.Tensor | None  # float32 [n, 1 + k]: the sampled token's, then the top k
    logprob_token_ids: torch.Tensor | None  # int32 [n, 1 + k]


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: float [n, vocab] for the sampled rows, in the same order as meta."""
        raise NotImplementedError
