"""The llama-family decoder (Llama 1-3.x, Mistral, Qwen2, Qwen3) over flattened tokens and a paged KV cache.

Per-architecture differences are switches on ModelConfig: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), tied embeddings, llama3 rope scaling. The q/k/v and gate/up projections are
fused into one matmul each; `load_hf_tensor` places a checkpoint tensor into its slice.

Under tensor parallelism (`tp`, see parallel.py) the modules hold one rank's shard: the layers
are built from the shard's shapes, o and down are followed by an all-reduce, and the embedding
and LM head hold one range of the vocabulary.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from stages.gpu_runner.attention import TorchBackend
from stages.gpu_runner.backend import AttentionBackend
from stages.gpu_runner.model_config import ModelConfig
from stages.gpu_runner.models.norm import RMSNorm
from stages.gpu_runner.models.rotary import RotaryEmbedding
from stages.gpu_runner.parallel import TensorParallel, shard_config, vocab_shard_size


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, backend: AttentionBackend, rope: Any, kv_cache: torch.Tensor,
                meta: Any) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = backend.qk_norm_rotary(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, rope)
        else:
            q, k = backend.rotary(q, k, rope)
        out = backend.attention(q, k, v, kv_cache, meta, self.scale)
        out = self.o_proj(out.reshape(num_tokens, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(nn.functional.silu(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, backend: AttentionBackend, rope: Any,
                kv_cache: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (x, residual): the hidden state is x + residual (residual None: x alone)."""
        norm = self.input_layernorm
        if residual is None:
            residual, x = x, backend.rms_norm(x, norm.weight, norm.eps)
        else:
            x, residual = backend.add_rms_norm(x, residual, norm.weight, norm.eps)
        x = self.self_attn(x, backend, rope, kv_cache, meta)
        norm = self.post_attention_layernorm
        x, residual = backend.add_rms_norm(x, residual, norm.weight, norm.eps)
        return self.mlp(x), residual


# checkpoint suffix -> (module attribute path, index of the slice in a fused weight or None)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaFamilyModel(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden]; logits(hidden) separately.

    `config` is the whole model's (the checkpoint's shapes); `shard` the shapes this rank holds."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.shard = shard_config(config, 1 if tp is None else tp.size)
        self.vocab_start = 0 if tp is None else tp.rank * vocab_shard_size(config.vocab_size, tp.size)
        num_vocab = config.vocab_size if tp is None else vocab_shard_size(config.vocab_size, tp.size)
        self.embed_tokens = nn.Embedding(num_vocab, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(self.shard, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, num_vocab, bias=False)
        self.rotary = RotaryEmbedding(config, max_positions, device)
        self.backend: AttentionBackend = TorchBackend(block_size=1)  # the runner sets its own

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any) -> torch.Tensor:
        """`meta` is the step's attention metadata, built by `self.backend`."""
        backend = self.backend
        x = self._embed(input_ids)
        rope = backend.rope(positions, self.rotary, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, backend, rope, kv_cache, meta)
        return x + residual

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(input_ids)
        # Each rank looks up the ids of its range and zeroes the others; the sum holds every row.
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(held, local, 0)) * held.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
        return self.tp.all_reduce(x)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """hidden [n, hidden] of the tokens to sample from -> float32 logits [n, vocab] (into `out` if given).
        Under tensor parallelism rank 0 gets the gathered logits and the other ranks None."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = torch.matmul(self.backend.rms_norm(hidden, self.norm.weight, self.norm.eps), weight.t())
        if self.tp is not None:
            logits = self.tp.gather_logits(logits, self.config.vocab_size)
            if logits is None:
                return None
        return logits.float() if out is None else out.copy_(logits)

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor name -> shape, for every tensor the checkpoint must provide."""
        c = self.config
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
            "model.norm.weight": (c.hidden_size,),
        }
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        out_sizes = {"q_proj": c.q_size, "k_proj": c.kv_size, "v_proj": c.kv_size}
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
            shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
            for name, size in out_sizes.items():
                shapes[p + f"self_attn.{name}.weight"] = (size, c.hidden_size)
                if c.qkv_bias:
                    shapes[p + f"self_attn.{name}.bias"] = (size,)
            shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, c.q_size)
            if c.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (c.hidden_size,)
            if c.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (c.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (c.head_dim,)
            for name in ("gate_proj", "up_proj"):
                shapes[p + f"mlp.{name}.weight"] = (c.intermediate_size, c.hidden_size)
                if c.mlp_bias:
                    shapes[p + f"mlp.{name}.bias"] = (c.intermediate_size,)
            shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
            if c.mlp_bias:
                shapes[p + "mlp.down_proj.bias"] = (c.hidden_size,)
        return shapes

    @torch.no_grad()
    def load_hf_tensor(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (name as in expected_hf_tensors, shape already checked; this
        rank's shard of it under tensor parallelism) in place."""
        module_path, _, kind = name.removeprefix("model.").rpartition(".")
        slice_index = None
        for suffix, (fused_path, index) in _FUSED.items():
            if module_path.endswith(suffix):
                module_path = module_path[: -len(suffix)] + fused_path
                slice_index = index
                break
        target: torch.Tensor = getattr(self.get_submodule(module_path), kind)
        if slice_index is not None:
            c = self.shard
            sizes = [c.q_size, c.kv_size, c.kv_size] if "qkv" in module_path else [c.intermediate_size] * 2
            start = sum(sizes[:slice_index])
            target = target[start:start + sizes[slice_index]]
        target.copy_(tensor)
