"""GGUF checkpoints: the HF config a file's metadata implies, and its tensors under HF names,
dequantized on read (or, where asked, 2-D weights of a type the CPU kernels multiply kept as their
blocks: layers/quantization/), with llama.cpp's conversions undone.

A mixture of experts (Mixtral, a "llama" file with an expert count; qwen2moe; qwen3moe) stores
each layer's experts stacked, one [experts, ...] tensor per projection (ffn_gate_exps,
ffn_up_exps, ffn_down_exps); they keep that form under the names mlp.experts.<proj>.weight.

llama.cpp's converter permutes the q and k rows of llama-architecture files (its rotary pairs
adjacent dimensions; HF pairs halves), and stores Gemma's RMSNorm weights as 1 + w. Both are
reversed here, so the model code sees what an HF checkpoint holds.
"""
from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stages.gpu_runner.cpu_ops import quant
from stages.gpu_runner.layers.quantization.base import QuantizedWeight
from stages.gpu_runner.loaders.gguf_file import GGUFError, GGUFFile, TensorInfo
from stages.gpu_runner.loaders.gguf_quants import dequantize
from stages.gpu_runner.models.config import ModelConfig, ModelLoadError

# general.architecture -> the HF architecture that serves it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM"}
_PERMUTED = ("llama", "mistral")  # q/k rows interleaved by the converter
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
          "attn_norm": "input_layernorm", "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
          "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
          "ffn_gate_inp_shexp": "mlp.shared_expert_gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
          "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj"}
# Norms whose meaning differs: llama's ffn_norm is the post-attention norm; Gemma 3 has four.
_BLOCK_NORMS = {"llama": {"ffn_norm": "post_attention_layernorm"},
                "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                           "post_ffw_norm": "post_feedforward_layernorm"}}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

log = logging.getLogger(__name__)


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's header, or ModelLoadError naming the file and what is wrong with it."""
    try:
        return GGUFFile(path)
    except GGUFError as exc:
        raise ModelLoadError(str(exc)) from None


def _arch(file: GGUFFile) -> str:
    arch = file.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{file.path}: GGUF architecture {arch!r} is not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}")
    return arch


def hf_name(gguf_name: str, arch: str) -> str | None:
    """A GGUF tensor's HF checkpoint name; None for a tensor this engine does not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    layer, part, kind = match.groups()
    norms = _BLOCK_NORMS["gemma3" if arch == "gemma3" else "llama"]
    module = norms.get(part) or _BLOCK.get(part)
    return None if module is None else f"model.layers.{layer}.{module}.{kind}"


def hf_config(file: GGUFFile) -> dict[str, Any]:
    """The config.json of an HF checkpoint of the same model, from the file's metadata."""
    arch = _arch(file)

    def meta(key: str, default: Any = None) -> Any:
        value = file.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{file.path}: metadata {arch}.{key} is missing")
        return value.item() if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else value

    hidden, num_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    num_layers = int(meta("block_count"))
    tokens = file.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else file.tensors["token_embd.weight"].shape[0]
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", num_heads)),
        "head_dim": int(meta("attention.key_length", hidden // num_heads)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "torch_dtype": "bfloat16",
        "bos_token_id": file.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": file.get("tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_output.bias" in file.tensors,
    }
    if "rope_freqs.weight" in file.tensors:
        raise ModelLoadError(f"{file.path}: rope_freqs.weight (llama3 rope scaling stored as factors) is not supported")
    if meta("rope.scaling.type", "none") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif meta("rope.scaling.type", "none") not in ("none", ""):
        raise ModelLoadError(f"{file.path}: rope scaling {meta('rope.scaling.type')!r} is not supported")
    config |= _moe_config(file, arch, meta)
    window = file.get(f"{arch}.attention.sliding_window")
    if arch == "gemma3":
        # llama.cpp makes every sixth Gemma 3 layer global and keeps the local base at 10,000.
        config |= {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": config["head_dim"],
                   "sliding_window": int(window), "rope_local_base_freq": 10000.0,
                   "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]}
    elif window is not None:
        config |= {"sliding_window": int(window), "use_sliding_window": True}
    return config


def _moe_config(file: GGUFFile, arch: str, meta) -> dict[str, Any]:
    """A mixture's config.json fields; llama.cpp renormalises the top-k weights of Mixtral and
    qwen3moe, not of qwen2moe, unless the file says otherwise (expert_weights_norm)."""
    if file.get(f"{arch}.expert_count") is None:
        return {}
    if arch not in ("llama", "qwen2moe", "qwen3moe"):
        raise ModelLoadError(f"{file.path}: experts of GGUF architecture {arch!r} are not supported "
                             f"(only Mixtral as llama, qwen2moe and qwen3moe)")
    num_experts, top_k = int(meta("expert_count")), int(meta("expert_used_count"))
    if arch == "llama":
        return {"architectures": ["MixtralForCausalLM"], "num_local_experts": num_experts, "num_experts_per_tok": top_k}
    config = {"num_experts": num_experts, "num_experts_per_tok": top_k,
              "moe_intermediate_size": int(meta("expert_feed_forward_length")),
              "norm_topk_prob": bool(meta("expert_weights_norm", arch == "qwen3moe"))}
    if arch == "qwen2moe":
        config["shared_expert_intermediate_size"] = int(meta("expert_shared_feed_forward_length"))
    return config


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, rows (0, half, 1, half + 1, ...) back to halves."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class GGUFSource:
    """A GGUF file's tensors by HF name, dequantized to float32 on read; with `keep_blocks`, a 2-D
    weight of a block type the CPU kernels multiply is read as a QuantizedWeight instead."""

    config_name = "the GGUF metadata"  # where the expected shapes come from, for errors

    def __init__(self, path: Path, config: ModelConfig, keep_blocks: bool = False) -> None:
        self.file = open_gguf(path)
        self.keep_blocks = keep_blocks
        self.kept: Counter[str] = Counter()  # block type -> tensors kept quantized
        self.decoded: Counter[str] = Counter()  # quantized type -> tensors dequantized all the same
        self.arch = _arch(self.file)
        self.config = config
        self._names = {}
        for gguf_name in self.file.tensors:
            name = hf_name(gguf_name, self.arch)
            if name is None:
                raise ModelLoadError(f"{path}: tensor {gguf_name} is not known for architecture {self.arch!r}")
            self._names[name] = gguf_name

    def __enter__(self) -> GGUFSource:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.keep_blocks:
            log.info("%s: weights kept as GGUF blocks: %s; dequantized at load (no CPU kernel for the type, "
                     "or the kernels not built): %s", self.file.path.name, _counts(self.kept), _counts(self.decoded))

    def names(self) -> list[str]:
        return list(self._names)

    def where(self, name: str) -> str:
        return f"{self.file.path.name} ({self._names[name]})"

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.tensors[self._names[name]].shape

    def read(self, name: str, index: object = None) -> torch.Tensor | QuantizedWeight:
        info = self.file.tensors[self._names[name]]
        if self.keep_blocks and index is None and len(info.shape) == 2 and info.qtype.value > 1:
            if quant.block_bytes(info.qtype.value):
                self.kept[info.qtype.name] += 1
                return self._blocks(name, info)
            self.decoded[info.qtype.name] += 1
        # One thread: decoding runs cache-sized chunks of small ops, which a second thread does
        # not speed up and slows many times over when another process holds the other core.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            tensor = dequantize(self.file.raw(info.name), info.qtype, info.shape, torch.float32, info.name)
        finally:
            torch.set_num_threads(threads)
        if self.arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = _unpermute(tensor, self.config.num_heads if "q_proj" in name else self.config.num_kv_heads)
        if self.arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor - 1.0
        return tensor if index is None else tensor[index]

    def _blocks(self, name: str, info: TensorInfo) -> QuantizedWeight:
        """The weight's blocks, one run per row, q/k rows un-permuted as read() does."""
        rows = info.shape[0]
        data = torch.from_numpy(np.array(self.file.raw(info.name), copy=True).reshape(-1).view(np.uint8))
        weight = QuantizedWeight(info.qtype.value, data.view(rows, -1), tuple(info.shape))
        if self.arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.config.num_heads if "q_proj" in name else self.config.num_kv_heads
            weight = weight.select_rows(_unpermute(torch.arange(rows), heads))
        return weight


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{count} {qtype}" for qtype, count in sorted(counter.items())) or "none"
