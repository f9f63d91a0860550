"""A draft model: a smaller checkpoint with the target's tokenizer proposes each row's drafts.

Its KV cache is paged like the target's, over the same block tables: block b of a row holds the
same positions in both caches. Each step the draft runs over the step's tokens with the step's
own attention metadata (`observe`), on the dynamic path and the static (graph) decode path alike,
so its cache covers every position the target has computed;
before a step that verifies drafts it decodes K tokens per verifying row from the row's last known
token (`propose`), greedily. Drafts are thus point masses (rejection.py) and the KV it writes
for drafts that get rejected is overwritten when those positions are computed again.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.contracts.speculative import SpeculativeConfig
from stages.gpu_runner.attention.interface import AttentionBackend
from stages.gpu_runner.attention.kv_cache import allocate_kv_caches, kv_block_bytes
from stages.gpu_runner.inputs.input_batch import InputBatch
from stages.gpu_runner.layers.kernels import LayerKernels
from stages.gpu_runner.loaders.loader import load_model
from stages.gpu_runner.models.config import load_model_config


@dataclass(frozen=True, slots=True)
class DraftTarget:
    """What a draft model takes of the target's runner: where and in what dtype to run, how long a
    sequence gets, the vocabulary its own must fit in, and the kernels both models run with."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    attention_backend: AttentionBackend
    layer_kernels: LayerKernels


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, target: DraftTarget) -> None:
        """Load the draft's weights to run beside `target` (its block tables and KV pool come with `bind`)."""
        config = load_model_config(spec.model)
        if config.vocab_size > target.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model}: its vocabulary ({config.vocab_size} tokens) "
                             f"is larger than the target's ({target.vocab_size}); a draft must share its tokenizer")
        if any(window is not None for window in config.kv_group_windows):
            raise ValueError(f"speculative_config.model {spec.model}: a draft model with sliding-window layers "
                             f"is not supported")
        self.k = spec.num_speculative_tokens
        self.config = config
        self.target = target
        self.model = load_model(spec.model, device=target.device, dtype=target.dtype,
                                max_positions=target.max_model_len, config=config)
        self.model.use_kernels(target.attention_backend, target.layer_kernels)
        self.batch: InputBatch | None = None
        self.kv_caches: list[torch.Tensor] = []

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of the draft's KV per block (the KV pool is sized for both models)."""
        return kv_block_bytes(self.config, block_size, dtype)

    def bind(self, batch: InputBatch, num_kv_blocks: int) -> None:
        """Allocate the draft's KV cache over the target's pool of `num_kv_blocks` and read the block
        tables of `batch` (the target's persistent batch)."""
        self.batch = batch
        # One block more than the pool: the scratch block padding rows write to, as the target's.
        self.kv_caches = allocate_kv_caches(self.config, num_kv_blocks + 1, batch.block_size, self.target.dtype,
                                            self.target.device)

    def observe(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: object) -> None:
        """Write the draft's KV of a step's tokens at the target's slots: `attention` is the step's
        metadata (the global group's, when the target's is a tuple of KV groups)."""
        meta = attention[0] if isinstance(attention, tuple) else attention
        self.model(input_ids, positions, self.kv_caches, meta)

    def propose(self, token_table: torch.Tensor, rows: torch.Tensor, num_known: torch.Tensor,
                max_known: int, num_drafts: int) -> torch.Tensor:
        """int64 [d, num_drafts]: each row's greedy continuation of its first num_known[i] tokens
        (num_drafts decode steps: as many as the most any row verifies)."""
        batch, bs, backend = self.batch, self.batch.block_size, self.target.attention_backend
        position = num_known - 1
        token = token_table[rows, position]
        drafts = []
        for i in range(num_drafts):
            slots = batch.block_table[rows, position // bs].to(torch.int64) * bs + position % bs
            meta = backend.decode_metadata(rows, position + 1, max_known + i, slots, batch.block_table)
            hidden = self.model(token, position, self.kv_caches, meta)
            token = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(token)
            position = position + 1
        return torch.stack(drafts, dim=1)
