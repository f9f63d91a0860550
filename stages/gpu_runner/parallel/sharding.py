"""Tensor parallelism's cut of the model: which checkpoint tensors each rank holds and the shapes it holds.

Megatron's cut: q/k/v and gate/up are column-parallel (each rank holds its own heads and its own
slice of the intermediate size), o and down are row-parallel and followed by one all-reduce
each, the embedding and the LM head are vocab-parallel (each rank holds a contiguous range of
token ids). KV heads are split like the query heads; with fewer KV heads than ranks each KV head
is held by the ranks whose query heads read it. A mixture of experts splits every expert's (and a
shared expert's) intermediate size the same way: gate/up column-parallel, down row-parallel; its
router is replicated. With expert parallelism a rank holds whole experts instead, the
num_experts / N of `local_experts`, and adds only their outputs before the same all-reduce.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

import torch

from stages.gpu_runner.models.config import ModelConfig

ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
ROW_PARALLEL_BIAS = ("self_attn.o_proj.bias", "mlp.down_proj.bias")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
# A mixture's experts (Mixtral's w1/w3/w2, Qwen's gate/up/down_proj) and Qwen2-MoE's shared expert.
_MOE_COLUMN = re.compile(r"(mlp|block_sparse_moe)\.(experts\.\d+\.(w1|w3|gate_proj|up_proj)"
                         r"|shared_expert\.(gate|up)_proj)\.weight")
_MOE_STACKED = re.compile(r"mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight")  # GGUF: [experts, rows, cols]
# gpt-oss's experts, every expert's in one tensor (gate and up interleaved column by column, MXFP4 as
# blocks and scales): [experts, H, 2I], [experts, 2I] and [experts, I, H]; blocks [experts, rows, groups, 16].
_GPT_OSS_STACKED = re.compile(r"mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)"
                              r"(_blocks|_scales)?")
_MOE_ROW = re.compile(r"(mlp|block_sparse_moe)\.(experts\.\d+\.(w2|down_proj)|shared_expert\.down_proj)\.weight")


def check_tensor_parallel(config: ModelConfig, size: int, device_type: str, local_ranks: int | None = None,
                          expert_parallel: bool = False) -> None:
    """ValueError naming both numbers when `size` ranks (`local_ranks` of them on this machine:
    all unless given) cannot share this model; with `expert_parallel` the ranks hold whole experts,
    so it is the experts, not their intermediate size, that `size` must divide."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size}")
    if config.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {config.num_heads} "
                         f"attention heads")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size {size} and the model's {kv} KV heads: one must divide the other")
    dense_mlps = not config.num_experts or not all(config.sparse_layers)
    if config.intermediate_size % size and dense_mlps:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate size "
                         f"{config.intermediate_size}")
    if expert_parallel and size > 1:
        if not config.num_experts:
            raise ValueError(f"enable_expert_parallel places experts on ranks; {config.architecture} has none "
                             f"(it is not a mixture of experts)")
        if config.num_experts % size:
            raise ValueError(f"expert parallelism over {size} ranks does not divide the model's "
                             f"{config.num_experts} experts")
    split = ("shared_expert_intermediate_size",) + (() if expert_parallel else ("moe_intermediate_size",))
    for name in split:
        if getattr(config, name) % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the model's {name.replace('_', ' ')} "
                             f"{getattr(config, name)}")
    if config.experts_mxfp4 and not expert_parallel and config.moe_intermediate_size // size % 32:
        raise ValueError(f"tensor_parallel_size {size} splits the MXFP4 experts' intermediate size "
                         f"{config.moe_intermediate_size} into {config.moe_intermediate_size // size}, not a multiple "
                         f"of its 32-value blocks; use enable_expert_parallel or a smaller size")
    local_ranks = size if local_ranks is None else local_ranks
    if device_type == "cuda" and local_ranks > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} puts {local_ranks} ranks on this machine, one per CUDA "
                         f"device; it has {torch.cuda.device_count()}")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shapes one of `size` ranks holds (heads and intermediate size divided; the vocabulary
    and hidden size are whole: the vocab-parallel layers keep their own sizes)."""
    if size == 1:
        return config
    experts_split = 1 if config.expert_parallel else size
    return dataclasses.replace(config, num_heads=config.num_heads // size,
                               num_kv_heads=max(1, config.num_kv_heads // size),
                               intermediate_size=config.intermediate_size // size,
                               moe_intermediate_size=config.moe_intermediate_size // experts_split,
                               shared_expert_intermediate_size=config.shared_expert_intermediate_size // size)


def local_experts(config: ModelConfig, rank: int, size: int) -> range:
    """The experts this rank holds and runs: all of them (each split) unless expert-parallel."""
    if not config.expert_parallel or size == 1:
        return range(config.num_experts)
    per_rank = config.num_experts // size
    return range(rank * per_rank, (rank + 1) * per_rank)


_EXPERT_INDEX = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")


def vocab_shard_size(vocab_size: int, size: int) -> int:
    """Token ids per rank of the vocab-parallel layers (the last rank's range is padded)."""
    return math.ceil(vocab_size / size)


def shard_tensor(name: str, read: Callable[[object], torch.Tensor], shape: tuple[int, ...], config: ModelConfig,
                 rank: int, size: int) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name` of full `shape`; `read(index)` reads a slice of
    it from the file (safetensors `get_slice`), so a rank never reads what it does not hold."""
    if size == 1:
        return read(slice(None))
    suffix = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
    if name in VOCAB_PARALLEL:
        per_rank = vocab_shard_size(config.vocab_size, size)
        start = rank * per_rank
        part = read(slice(start, min(start + per_rank, config.vocab_size)))
        if part.shape[0] < per_rank:  # the last rank's padded tail: never looked up, cut from the gathered logits
            part = torch.cat([part, part.new_zeros(per_rank - part.shape[0], *part.shape[1:])])
        return part
    gpt_oss = _GPT_OSS_STACKED.fullmatch(suffix)
    if config.expert_parallel and (gpt_oss or _MOE_STACKED.fullmatch(suffix) or _EXPERT_INDEX.match(suffix)):
        held = local_experts(config, rank, size)
        if gpt_oss or _MOE_STACKED.fullmatch(suffix):
            return read(slice(held.start, held.stop))
        # Another rank's expert is not read at all.
        return read(slice(None)) if int(_EXPERT_INDEX.match(suffix).group(1)) in held else torch.empty(0)
    if gpt_oss:
        return _gpt_oss_expert_shard(gpt_oss.group(1), gpt_oss.group(2), read, shape, rank, size)
    if stacked := _MOE_STACKED.fullmatch(suffix):
        dim = 2 if stacked.group(1) == "down_proj" else 1
        per_rank = shape[dim] // size
        return read((slice(None),) * dim + (slice(rank * per_rank, (rank + 1) * per_rank),))
    if suffix in ROW_PARALLEL or _MOE_ROW.fullmatch(suffix):
        per_rank = shape[1] // size
        return read((slice(None), slice(rank * per_rank, (rank + 1) * per_rank)))
    if suffix in ROW_PARALLEL_BIAS:  # added once, after the all-reduce sums the ranks' parts
        full = read(slice(None))
        return full if rank == 0 else torch.zeros_like(full)
    head_dim = config.head_dim
    column = ("self_attn.q_proj.", "self_attn.sinks", "mlp.gate_proj.", "mlp.up_proj.")  # sinks: one per head
    if suffix.startswith(column) or _MOE_COLUMN.fullmatch(suffix):
        per_rank = shape[0] // size
        return read(slice(rank * per_rank, (rank + 1) * per_rank))
    if suffix.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        kv = config.num_kv_heads
        if kv >= size:
            per_rank = shape[0] // size
            return read(slice(rank * per_rank, (rank + 1) * per_rank))
        head = rank * kv // size  # the KV head this rank's query heads read
        return read(slice(head * head_dim, (head + 1) * head_dim))
    return read(slice(None))  # norms: replicated


def _gpt_oss_expert_shard(name: str, stored: str | None, read: Callable[[object], torch.Tensor],
                          shape: tuple[int, ...], rank: int, size: int) -> torch.Tensor:
    """This rank's slice of every gpt-oss expert's intermediate units: gate/up's interleaved pairs
    are contiguous columns (rows when stored as MXFP4 blocks), down's rows (its blocks' groups);
    down's bias is added once, by rank 0, after the all-reduce."""
    if name == "down_proj_bias":
        full = read(slice(None))
        return full if rank == 0 else torch.zeros_like(full)
    if name.startswith("gate_up_proj"):
        dim = 1 if stored or name == "gate_up_proj_bias" else 2
    else:
        dim = 2 if stored else 1
    per_rank = shape[dim] // size
    return read((slice(None),) * dim + (slice(rank * per_rank, (rank + 1) * per_rank),))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter this rank holds, and of the quantized weights (layers/linear.py
    hold_weight) that replace some."""
    held = [module.weight for module in model.modules() if "weight" in module.__dict__]
    parts = [part for weight in held for part in (weight if isinstance(weight, tuple) else (weight,))]
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(part.nbytes for part in parts)
