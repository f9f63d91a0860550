"""A draft model: a smaller checkpoint with the target's tokenizer proposes each row's drafts.

Its KV cache is paged like the target's, over the same block tables: block b of a row holds the
same positions in both caches. Each step the draft runs over the step's tokens with the step's
own attention metadata (`observe`), so its cache covers every position the target has computed;
before a step that verifies drafts it decodes K tokens per verifying row from the row's last known
token (`propose`), greedily. Drafts are thus point masses (rejection.py) and the KV it writes
for drafts that get rejected is overwritten when those positions are computed again.
"""
from __future__ import annotations

import torch

from stages.contracts.speculative import SpeculativeConfig
from stages.gpu_runner.kv_cache import allocate_kv_caches, kv_block_bytes
from stages.gpu_runner.loader import load_model
from stages.gpu_runner.model_config import load_model_config
from stages.gpu_runner.step_inputs import StepInputs


class DraftModelProposer:
    def __init__(self, spec: SpeculativeConfig, runner) -> None:
        """Load the draft's weights. `runner`: the ModelRunner whose device, dtype, attention backend
        and vocabulary the draft shares (its block tables and KV pool come with `bind`)."""
        config = load_model_config(spec.model)
        if config.vocab_size > runner.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model}: its vocabulary ({config.vocab_size} tokens) "
                             f"is larger than the target's ({runner.vocab_size}); a draft must share its tokenizer")
        if any(window is not None for window in config.kv_group_windows):
            raise ValueError(f"speculative_config.model {spec.model}: a draft model with sliding-window layers "
                             f"is not supported")
        self.k = spec.num_speculative_tokens
        self.config = config
        self.model = load_model(spec.model, device=runner.device, dtype=runner.dtype,
                                max_positions=runner.max_model_len, config=config)
        self.backend = runner.attention_backend
        self.model.backend = self.backend
        self.batch = None
        self.kv_caches: list[torch.Tensor] = []

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of the draft's KV per block (the KV pool is sized for both models)."""
        return kv_block_bytes(self.config, block_size, dtype)

    def bind(self, runner) -> None:
        """Allocate the draft's KV cache over the runner's pool and read its block tables."""
        self.batch = runner.batch
        # One block more than the pool: the scratch block padding rows write to, as the target's.
        self.kv_caches = allocate_kv_caches(self.config, runner.num_kv_blocks + 1, runner.block_size, runner.dtype,
                                            runner.device)

    def observe(self, inputs: StepInputs) -> None:
        """Write the draft's KV of the step's tokens, at the target's slots."""
        meta = inputs.attention[0] if isinstance(inputs.attention, tuple) else inputs.attention
        self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)

    def propose(self, token_table: torch.Tensor, rows: torch.Tensor, num_known: torch.Tensor,
                max_known: int) -> torch.Tensor:
        """int64 [d, K]: each row's greedy continuation of its first num_known[i] tokens."""
        batch, bs = self.batch, self.batch.block_size
        position = num_known - 1
        token = token_table[rows, position]
        drafts = []
        for i in range(self.k):
            slots = batch.block_table[rows, position // bs].to(torch.int64) * bs + position % bs
            meta = self.backend.decode_metadata(rows, position + 1, max_known + i, slots, batch.block_table)
            hidden = self.model(token, position, self.kv_caches, meta)
            token = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts.append(token)
            position = position + 1
        return torch.stack(drafts, dim=1)
