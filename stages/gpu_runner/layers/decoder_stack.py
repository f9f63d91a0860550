"""A decode step through every decoder layer of a model in one CPU operator (cpu_ops/decoder.c),
where its weights are GGUF blocks: the Llama family (Llama, Mistral, Qwen3, SmolLM2) and Gemma 3.

One stream of a small quantized model decodes in tens of milliseconds, of which the products were
about a third: the rest was the interpreter and the operator dispatch between the ten or so
kernels of each layer. The operator runs those same kernels on the same values in the same order,
so the hidden state it returns equals the layer-by-layer forward's to the bit
(tests/gpu_runner/test_decoder_stack.py); the layers stay the model's definition and serve
everything the operator does not take (prefill, more tokens than the quantized kernels take,
dense weights, biases, tensor parallelism, the Triton backend, layers that do not say where their
norms go: `STACK_NORMS`).

A decoder layer class that the stack can run names its norms' modules in `STACK_NORMS`: (input,
attention-out or None, MLP, MLP-out or None), the Llama layer's two or Gemma 3's sandwich of four.
"""
from __future__ import annotations

import torch
from torch import nn

from stages.gpu_runner import cpu_ops
from stages.gpu_runner.attention.torch_metadata import AttentionMetadata
from stages.gpu_runner.layers.mlp import GatedMLP
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.layers.quantization.gguf import TORCH_TILES, kernel_for

ACTIVATIONS = {"silu": False, "gelu_pytorch_tanh": True}  # hidden_act -> the operator's `gelu`


def _parts(weight: object, count: int) -> list[QuantizedWeight] | None:
    """A merged projection's weight as the operator's `count` slots (the merged one first, the rest
    None), or its parts; None where it is not GGUF blocks."""
    if isinstance(weight, QuantizedWeight):
        return [weight] + [None] * (count - 1)
    if isinstance(weight, tuple) and len(weight) == count and all(isinstance(p, QuantizedWeight) for p in weight):
        return list(weight)
    return None


class DecoderStack:
    """The model's layers as the operator's arguments, gathered once (`of` says whether it applies).
    `model` is a models/base.CausalLM: its config, shard, layers and rotary tables are read."""

    def __init__(self, model: nn.Module, weights: list, products: list, key_sets: list, ropes: list,
                 layer_numbers: list[tuple[int, int]], gelu: bool) -> None:
        config = model.shard
        self.weights, self.products, self.gelu = weights, products, gelu
        self.key_sets = key_sets  # (KV group, window) of each key set
        self.ropes = [model.rotary[name] for name in ropes]
        self.layer_numbers = layer_numbers  # per layer: its key set and rotary table
        self.heads, self.kv_heads = config.num_heads, config.num_kv_heads
        self.scale, self.eps, self.unit_offset = config.scale, config.rms_norm_eps, config.norm_unit_offset
        self._layouts: dict[int, list[int] | None] = {}  # by number of tokens

    @classmethod
    def of(cls, model: nn.Module) -> DecoderStack | None:
        """The stack of `model`'s layers, or None where the operator does not take them (see above)."""
        config = model.config
        if (model.tp is not None or cpu_ops.library() is None or config.qkv_bias or config.o_bias
                or config.mlp_bias or config.attention_sinks or config.head_dim % 16
                or config.hidden_act not in ACTIVATIONS):
            return None
        weights: list[torch.Tensor | None] = []
        products: list[QuantizedWeight | None] = []
        key_sets: list[tuple[int, int | None]] = []
        ropes: list[str] = []
        numbers: list[tuple[int, int]] = []
        for layer in model.layers:
            names = getattr(layer, "STACK_NORMS", None)
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if names is None or attention is None or not isinstance(mlp, GatedMLP):
                return None
            norms = [None if name is None else getattr(layer, name) for name in names]
            norms += [attention.q_norm, attention.k_norm]
            if any(norm is not None and (norm.weight.dtype != torch.float32 or norm.eps != config.rms_norm_eps
                                         or norm.unit_offset != config.norm_unit_offset) for norm in norms):
                return None
            qkv, gate_up = _parts(attention.qkv_proj.weight, 3), _parts(mlp.gate_up_proj.weight, 2)
            o, down = attention.o_proj.weight, mlp.down_proj.weight
            whole = all(isinstance(weight, QuantizedWeight) for weight in (o, down))
            if qkv is None or gate_up is None or not whole:
                return None
            layer_products = [*qkv, o, *gate_up, down]
            weights += [None if norm is None else norm.weight for norm in norms]
            weights += [None if weight is None else weight.blocks for weight in layer_products]
            products.append(layer_products)
            key_set = (attention.kv_group, attention.window)
            if key_set not in key_sets:
                key_sets.append(key_set)
            if attention.rope not in ropes:
                ropes.append(attention.rope)
            numbers.append((key_sets.index(key_set), ropes.index(attention.rope)))
        return cls(model, weights, products, key_sets, ropes, numbers, ACTIVATIONS[config.hidden_act])

    def layout(self, num_tokens: int) -> list[int] | None:
        """Per layer: (block type, kernel) of each product slot at `num_tokens` rows (gguf.kernel_for),
        then its key set and rotary table; None where a product would run in torch (a long prefill's)."""
        if num_tokens not in self._layouts:
            layout: list[int] | None = []
            for layer_products, numbers in zip(self.products, self.layer_numbers):
                for weight in layer_products:
                    kind = 0 if weight is None else kernel_for(weight, num_tokens, torch.float32)
                    if kind == TORCH_TILES:
                        layout = None
                        break
                    layout += [0 if weight is None else weight.qtype, kind]
                if layout is None:
                    break
                layout += numbers
            self._layouts[num_tokens] = layout
        return self._layouts[num_tokens]

    def takes(self, x: torch.Tensor, kv_caches: list[torch.Tensor], meta: object) -> bool:
        """Whether this step is one the operator runs: float32 rows on the CPU, each decoding or
        verifying drafts (no prefill), over a cache of a dtype the attention kernel reads. (The
        model builds its stack for the torch backend and kernels only: CausalLM.use_kernels.)"""
        metas = meta if isinstance(meta, tuple) else (meta,)
        return (x.dtype == torch.float32 and x.is_cpu
                and all(isinstance(m, AttentionMetadata) and not m.prefills for m in metas)
                and kv_caches[0].dtype in cpu_ops.SUPPORTED and self.layout(x.shape[0]) is not None)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 meta: AttentionMetadata | tuple[AttentionMetadata, ...]) -> torch.Tensor:
        """x [tokens, hidden] (the embeddings, scaled) -> the last layer's hidden state, x + residual."""
        metas = meta if isinstance(meta, tuple) else (meta,)
        num_tokens = x.shape[0]
        sets = [(metas[group], attended_keys(metas[group].for_window(window), num_tokens))
                for group, window in self.key_sets]
        tables = [rope(positions, torch.float32) for rope in self.ropes]
        return cpu_ops.operators().decoder_layers(
            x, self.weights, self.layout(num_tokens), kv_caches, [cos for cos, _ in tables],
            [sin for _, sin in tables], [m.slot_mapping for m, _ in sets], [keys[1] for _, keys in sets],
            [keys[2] for _, keys in sets], [keys[0] for _, keys in sets], self.heads, self.kv_heads, self.scale,
            self.eps, self.unit_offset, self.gelu)


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
