"""What every decoder-only family shares around its layers: embeddings, the layer loop over a paged
KV cache, the final norm and LM head, rotary tables, and placing checkpoint tensors.

A family subclasses `CausalLM` with its decoder layer (`make_layer`); a layer maps
(x, residual) -> (x, residual), the hidden state being x + residual (residual None: x alone).
Under tensor parallelism the modules hold one rank's shard (see parallel/sharding.py and layers/linear.py).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from stages.gpu_runner.attention.interface import AttentionBackend
from stages.gpu_runner.attention.torch_backend import TorchBackend
from stages.gpu_runner.layers.attention import ForwardContext
from stages.gpu_runner.layers.decoder_stack import DecoderStack
from stages.gpu_runner.layers.embedding import VocabEmbedding, lm_logits
from stages.gpu_runner.layers.kernels import LayerKernels, TorchKernels
from stages.gpu_runner.layers.linear import PACKED, MergedColumnLinear, load_weight
from stages.gpu_runner.layers.norm import RMSNorm
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.layers.rotary import RopeSpec, RotaryEmbedding
from stages.gpu_runner.models.config import ModelConfig
from stages.gpu_runner.parallel.group import TensorParallel
from stages.gpu_runner.parallel.sharding import shard_config


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden]; logits(hidden) separately.

    `config` is the whole model's (the checkpoint's shapes); `shard` the shapes this rank holds."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.shard = shard_config(config, 1 if tp is None else tp.size)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(self.make_layer(i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, self.embed_tokens.num_embeddings, bias=False)
        self.rotary = {"global": RotaryEmbedding(RopeSpec.of(config), max_positions, device)}
        if config.local_rope_theta is not None:
            self.rotary["local"] = RotaryEmbedding(RopeSpec(config.head_dim, config.local_rope_theta),
                                                   max_positions, device)
        # The runner sets its own (use_kernels).
        self.attention_backend: AttentionBackend = TorchBackend(block_size=1)
        self.layer_kernels: LayerKernels = TorchKernels()
        self.decoder_stack: DecoderStack | None = None

    def use_kernels(self, attention_backend: AttentionBackend, layer_kernels: LayerKernels) -> None:
        """Run attention with `attention_backend` and the norms and rotary with `layer_kernels`; with
        the weights loaded, a decode step of few rows on the CPU may run every layer in one operator
        (layers/decoder_stack.py)."""
        self.attention_backend = attention_backend
        self.layer_kernels = layer_kernels
        plain = attention_backend.name == "torch" and isinstance(layer_kernels, TorchKernels)
        self.decoder_stack = DecoderStack.of(self) if plain else None

    def make_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any) -> torch.Tensor:
        """`meta` is the step's attention metadata, built by `self.attention_backend` (a tuple of one per KV
        group for a model with two)."""
        kernels = self.layer_kernels
        x = self.embed_tokens(input_ids)
        if self.config.embedding_scale:
            # The factor is rounded to the activations' dtype first, as the reference does.
            x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        if self.decoder_stack is not None and self.decoder_stack.takes(x, kv_caches, meta):
            return self.decoder_stack(x, positions, kv_caches, meta)
        ropes = {kind: kernels.rope(positions, table, x.dtype) for kind, table in self.rotary.items()}
        ctx = ForwardContext(self.attention_backend, kernels, meta if isinstance(meta, tuple) else (meta,), ropes)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, kv_cache, ctx)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """hidden [n, hidden] of the tokens to sample from -> float32 logits [n, vocab] (into `out` if given).
        Under tensor parallelism rank 0 gets the gathered logits and the other ranks None."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_logits(self.layer_kernels.rms_norm(hidden, self.norm), weight, self.tp, self.config.vocab_size,
                         self.config.final_logit_softcapping, out)

    def expected_hf_tensors(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint tensor name -> shape, for every tensor the checkpoint must provide."""
        c = self.config
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
            "model.norm.weight": (c.hidden_size,),
        }
        if not c.tie_word_embeddings:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for i, layer in enumerate(self.layers):
            shapes |= layer.expected_tensors(c, f"model.layers.{i}.")
        return shapes

    @torch.no_grad()
    def load_hf_tensor(self, name: str, tensor: torch.Tensor | QuantizedWeight) -> None:
        """Copy one checkpoint tensor (name as in expected_hf_tensors, shape already checked; this
        rank's shard of it under tensor parallelism) in place; quantized blocks replace the parameter."""
        module_path, _, kind = name.removeprefix("model.").rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf in PACKED:
            merged, index = PACKED[leaf]
            module = self.get_submodule(f"{parent}.{merged}")
            assert isinstance(module, MergedColumnLinear)
            module.load_part(index, kind, tensor)
            return
        load_weight(self.get_submodule(module_path), kind, tensor)
