"""A decode step through every decoder layer of a Llama-family model in one CPU operator
(cpu_ops/decoder.c), where its weights are GGUF blocks.

One stream of a small quantized model decodes in tens of milliseconds, of which the products are
about a third: the rest was the interpreter and the operator dispatch between the ten or so
kernels of each layer. The operator runs those same kernels on the same values in the same order,
so the hidden state it returns equals the layer-by-layer forward's to the bit
(tests/gpu_runner/test_decoder_stack.py); the layers stay the model's definition and serve
everything the operator does not take (prefill, verify rows, more rows than the fused products
take, dense weights, biases, per-head norms, tensor parallelism, other attention backends).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.attention.torch_metadata import AttentionMetadata
from stages.gpu_runner.layers.kernels import TorchKernels
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.layers.quantization.gguf import TORCH_TILES, kernel_for

if TYPE_CHECKING:
    from stages.gpu_runner.models.base import CausalLM

# Switched off by tests that compare the two paths (and by nothing else).
ENABLED = True


class DecoderStack:
    """The model's layers as the operator's arguments, gathered once (`of` says whether it applies)."""

    def __init__(self, model: CausalLM, weights: list[torch.Tensor], products: list[QuantizedWeight],
                 window: int | None) -> None:
        config = model.shard
        self.rotary = model.rotary["global"]
        self.weights, self.products, self.window = weights, products, window
        self.qtypes = [weight.qtype for weight in products]
        self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
        self.scale, self.eps = config.scale, config.rms_norm_eps
        self.unit_offset = config.norm_unit_offset
        self._kinds: dict[int, list[int] | None] = {}  # by number of tokens

    @classmethod
    def of(cls, model: CausalLM) -> DecoderStack | None:
        """The stack of `model`'s layers, or None where the operator does not take them: a weight
        not of GGUF blocks in one type, a bias, a per-head norm, a GeGLU, tensor parallelism,
        layers of different windows or rotary tables, attention sinks, or no CPU kernels."""
        config = model.config
        if (model.tp is not None or cpu_ops.library() is None or config.qkv_bias or config.o_bias
                or config.mlp_bias or config.qk_norm or config.attention_sinks or config.head_dim % 16
                or len(set(config.layer_windows)) != 1 or len(model.rotary) != 1):
            return None
        weights: list[torch.Tensor] = []
        products: list[QuantizedWeight] = []
        for layer in model.layers:
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attention is None or not getattr(mlp, "swiglu", False) or attention.sinks is not None:
                return None
            held = (attention.qkv_proj.weight, attention.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
            if not all(isinstance(weight, QuantizedWeight) for weight in held):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(norm.dtype != torch.float32 for norm in norms):
                return None
            weights += [norms[0], held[0].blocks, held[1].blocks, norms[1], held[2].blocks, held[3].blocks]
            products += held
        return cls(model, weights, products, config.layer_windows[0])

    def kinds(self, num_tokens: int) -> list[int] | None:
        """Each product's kernel at `num_tokens` rows (gguf.kernel_for), or None where one of them
        would run in torch (a long prefill's)."""
        if num_tokens not in self._kinds:
            kinds = [kernel_for(weight, num_tokens, torch.float32) for weight in self.products]
            self._kinds[num_tokens] = None if TORCH_TILES in kinds else kinds
        return self._kinds[num_tokens]

    def takes(self, x: torch.Tensor, kv_caches: list[torch.Tensor], meta: object, kernels: object) -> bool:
        """Whether this step is one the operator runs: float32 rows on the CPU, each decoding or
        verifying drafts (no prefill), through the torch backend's metadata and kernels, over a
        cache of a dtype the attention kernel reads."""
        return (ENABLED and x.dtype == torch.float32 and x.is_cpu and isinstance(meta, AttentionMetadata)
                and not meta.prefills and isinstance(kernels, TorchKernels) and kv_caches[0].dtype in cpu_ops.SUPPORTED
                and self.kinds(x.shape[0]) is not None)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata) -> torch.Tensor:
        """x [tokens, hidden] (the embeddings) -> the last layer's hidden state, x + residual."""
        queries, key_slots, mask = attended_keys(meta.for_window(self.window), x.shape[0])
        cos, sin = self.rotary(positions, torch.float32)
        return cpu_ops.operators().decoder_layers(
            x, self.weights, self.qtypes, self.kinds(x.shape[0]), kv_caches, cos, sin, meta.slot_mapping, key_slots,
            mask, queries, self.heads, self.kv_heads, self.scale, self.eps, self.unit_offset)


def attended_keys(meta: AttentionMetadata, num_tokens: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(queries, key_slots [rows, keys], mask [rows, queries, keys]) of a step of decode and verify
    rows, tokens in order as rows of `queries`: a step of decodes (one query a row) or of one group
    of rows verifying as many drafts, as the metadata holds them; any other mix one token a row,
    each token given its row's keys (padded to the longest, masked)."""
    decode, verify = meta.decode, meta.verify
    if decode is not None and decode.token_idx is None:
        return 1, decode.key_slots, decode.mask
    groups = [] if decode is None else [(decode.token_idx, decode.key_slots, decode.mask, 1)]
    groups += [(batch.token_idx, batch.key_slots, batch.mask, batch.num_queries) for batch in verify]
    if len(groups) == 1:
        token_idx, key_slots, mask, queries = groups[0]
        if torch.equal(token_idx, torch.arange(num_tokens)):
            return queries, key_slots, mask
    width = max(key_slots.shape[1] for _, key_slots, _, _ in groups)
    slots = torch.zeros(num_tokens, width, dtype=torch.int64)
    seen = torch.zeros(num_tokens, 1, width, dtype=torch.bool)
    for token_idx, key_slots, mask, queries in groups:
        rows, keys = key_slots.shape
        slots[token_idx, :keys] = key_slots.repeat_interleave(queries, dim=0)
        seen[token_idx, 0, :keys] = mask.reshape(rows * queries, keys)
    return 1, slots, seen
