"""The model's shape and options, read from a checkpoint directory's config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: the message names the file, tensor or setting at fault."""


# HF architecture name -> per-family switches (see ModelConfig).
LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
GEMMA3_FAMILY = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
# Llama-style attention with a mixture of experts in place of (some) MLPs.
MOE_FAMILY = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# A mixture of experts with attention sinks, alternating sliding/full layers and a clamped SwiGLU.
GPT_OSS = "GptOssForCausalLM"
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + GEMMA3_FAMILY + MOE_FAMILY + (GPT_OSS,)
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RopeScaling:
    """Llama 3 frequency-dependent rope scaling; the only scaling supported."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN rope scaling (transformers' _compute_yarn_parameters): frequencies between the
    correction range's dimensions are blended from interpolated (divided by `factor`) to
    extrapolated, and cos/sin are multiplied by `attention_factor`."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the correction range rounded outward to whole dimensions
    attention_factor: float | None = None  # None: 0.1 * ln(factor) + 1 (mscale / mscale_all_dim when given)
    mscale: float | None = None
    mscale_all_dim: float | None = None


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    # Tokens a query may attend back to, when the model limits it (Mistral v0.1: 4096).
    sliding_window: int | None
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama if attention_bias)
    o_bias: bool  # bias on the output projection (Llama/Qwen3 attention_bias)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)
    torch_dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # Each layer's attention window (None: global). Gemma 3 alternates local and global layers;
    # Mistral/Qwen2 with a sliding window use it on every layer.
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh (Gemma)
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma 3: query_pre_attn_scalar ** -0.5)
    norm_unit_offset: bool = False  # RMSNorms scale by (1 + weight) (Gemma)
    embedding_scale: bool = False  # embeddings multiplied by sqrt(hidden_size) (Gemma)
    local_rope_theta: float | None = None  # the rotary base of local layers, when it differs (Gemma 3)
    rope_linear_factor: float = 1.0  # linear rope scaling of the global layers
    final_logit_softcapping: float | None = None
    gguf_file: str | None = None  # weights read from this GGUF file instead of safetensors
    # Mixture of experts (MOE_FAMILY; num_experts 0: a dense model). Each token's FFN is the
    # weighted sum of num_experts_per_tok experts of moe_intermediate_size, chosen by the router.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert, under a sigmoid gate (0: none)
    sparse_layers: tuple[bool, ...] = ()  # per layer: experts (True) or a dense MLP of intermediate_size
    expert_parallel: bool = False  # tensor-parallel ranks hold whole experts (see parallel/sharding.py)
    rope_yarn: YarnScaling | None = None
    # gpt-oss: a learned logit per head joins each softmax's denominator (attention sinks); the
    # router takes the top k of its logits, then their softmax; experts use the clamped SwiGLU.
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    experts_mxfp4: bool = False  # gpt-oss experts stored as MXFP4 blocks and scales, dequantized at load

    @property
    def family(self) -> str:
        return "gemma3" if self.architecture in GEMMA3_FAMILY else "llama"

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """The window of each KV group: its layers share block tables and a block pool. One group
        when every layer has the same window (None: full attention); Gemma 3's global layers are
        group 0 and its local ones group 1, whose blocks are released once out of the window."""
        windows = set(self.layer_windows)  # one config window: at most {None, W}
        return tuple(windows) if len(windows) == 1 else (None, self.sliding_window)

    def kv_group(self, layer: int) -> int:
        return 0 if len(self.kv_group_windows) == 1 or self.layer_windows[layer] is None else 1

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _as_id_list(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise ModelLoadError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _require(cfg: dict, key: str, path: Path) -> int | float:
    if key not in cfg:
        raise ModelLoadError(f"{path}: missing {key!r}")
    return cfg[key]


def _rope(cfg: dict, path: Path,
          layer_type: str = "full_attention") -> tuple[float, RopeScaling | YarnScaling | float | None]:
    """(theta, scaling): scaling is None, a llama3 RopeScaling, a YarnScaling, or a linear factor (float)."""
    # transformers 4 writes rope_theta + rope_scaling; transformers 5 writes rope_parameters,
    # keyed by layer type for models that mix them (Gemma 3).
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if layer_type in params and isinstance(params[layer_type], dict):
        params = dict(params[layer_type])
    elif any(isinstance(value, dict) for value in params.values()):
        params = {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, float(params["factor"])
    if rope_type == "yarn":
        return theta, _yarn(params, cfg, path)
    if rope_type != "llama3":
        raise ModelLoadError(f"{path}: rope scaling type {rope_type!r} is not supported "
                             "(only 'llama3', 'linear' and 'yarn')")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: llama3 rope scaling is missing {exc.args[0]!r}") from exc
    return theta, scaling


def _yarn(params: dict, cfg: dict, path: Path) -> YarnScaling:
    def optional(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    original = int(params.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 0))
    if original <= 0:
        raise ModelLoadError(f"{path}: yarn rope scaling needs original_max_position_embeddings")
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(cfg["max_position_embeddings"]) / original
    return YarnScaling(factor=factor, original_max_position_embeddings=original,
                       beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                       truncate=bool(params.get("truncate", True)), attention_factor=optional("attention_factor"),
                       mscale=optional("mscale"), mscale_all_dim=optional("mscale_all_dim"))


def _layer_windows(cfg: dict, arch: str, num_layers: int, sliding_window: int | None,
                   path: Path) -> tuple[int | None, ...]:
    """Each layer's attention window: Gemma 3 by `layer_types` (older configs: a pattern where
    every n-th layer is global), the others one window for every layer or none."""
    if arch not in GEMMA3_FAMILY and arch != GPT_OSS:
        return (sliding_window,) * num_layers
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # gpt-oss: every other layer sliding, from the first
        pattern = int(cfg.get("sliding_window_pattern", 2 if arch == GPT_OSS else 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{path}: layer_types must name sliding_attention or full_attention for each of "
                             f"the {num_layers} layers, got {layer_types!r}")
    if sliding_window is None and "sliding_attention" in layer_types:
        raise ModelLoadError(f"{path}: layer_types has sliding_attention layers but no sliding_window is set")
    return tuple(sliding_window if kind == "sliding_attention" else None for kind in layer_types)


def _moe(cfg: dict, arch: str, num_layers: int, path: Path) -> dict:
    """The ModelConfig fields of a mixture of experts (none for a dense architecture)."""
    if arch == GPT_OSS:
        quantization = (cfg.get("quantization_config") or {}).get("quant_method")
        if quantization not in (None, "mxfp4"):
            raise ModelLoadError(f"{path}: gpt-oss weights quantized as {quantization!r} are not supported "
                                 "(only dense weights and MXFP4 experts)")
        num_experts = int(_require(cfg, "num_local_experts", path))
        top_k = int(_require(cfg, "num_experts_per_tok", path))
        if not 0 < top_k <= num_experts:
            raise ModelLoadError(f"{path}: num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
        return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(_require(cfg, "intermediate_size", path)),
                    sparse_layers=(True,) * num_layers, attention_sinks=True,
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)), swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                    experts_mxfp4=quantization == "mxfp4")
    if arch not in MOE_FAMILY:
        return {}
    mixtral = arch == "MixtralForCausalLM"
    num_experts = int(_require(cfg, "num_local_experts" if mixtral else "num_experts", path))
    top_k = int(_require(cfg, "num_experts_per_tok", path))
    if not 0 < top_k <= num_experts:
        raise ModelLoadError(f"{path}: num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(mixtral or (i not in dense and (i + 1) % step == 0) for i in range(num_layers))
    return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(_require(cfg, "intermediate_size" if mixtral else "moe_intermediate_size", path)),
                # Mixtral always renormalises; the Qwen MoEs when norm_topk_prob says so.
                norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0))
                if arch == "Qwen2MoeForCausalLM" else 0,
                sparse_layers=sparse)



def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse config.json (and generation_config.json for EOS ids) of a local checkpoint."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"model directory not found: {root}")
    path = root / "config.json"
    top = _read_json(path)
    architectures = top.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    # A multimodal Gemma 3 nests its language model's settings; only the text model is served.
    cfg = {**top, **top["text_config"]} if isinstance(top.get("text_config"), dict) else top
    is_gemma = arch in GEMMA3_FAMILY
    activation = cfg.get("hidden_activation" if is_gemma else "hidden_act", "gelu_pytorch_tanh" if is_gemma else "silu")
    if activation not in _ACTIVATIONS:
        raise ModelLoadError(f"{path}: activation {activation!r} is not supported (only {', '.join(_ACTIVATIONS)})")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{path}: attn_logit_softcapping is not supported")

    hidden = int(_require(cfg, "hidden_size", path))
    num_heads = int(_require(cfg, "num_attention_heads", path))
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{path}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    num_layers = int(_require(cfg, "num_hidden_layers", path))
    # Gemma 3's global base defaults to 1e6; its local base is rope_local_base_freq, never scaled.
    default_theta = 1_000_000.0 if is_gemma else 150_000.0 if arch == GPT_OSS else None
    theta, scaling = _rope(cfg if default_theta is None else {"rope_theta": default_theta, **cfg}, path)
    local_theta = None
    if is_gemma:
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
        if "sliding_attention" in (cfg.get("rope_parameters") or {}):
            local_theta, local_scaling = _rope({**cfg, "rope_theta": local_theta}, path, "sliding_attention")
            if local_scaling is not None:
                raise ModelLoadError(f"{path}: rope scaling of the sliding layers is not supported")

    dtype_name = top.get("torch_dtype") or top.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ModelLoadError(f"{path}: torch_dtype {dtype_name!r} is not supported; use one of {sorted(_DTYPES)}")

    sliding_window = cfg.get("sliding_window")
    if arch in _QWEN and not cfg.get("use_sliding_window", False):
        sliding_window = None
    sliding_window = None if sliding_window is None else int(sliding_window)

    eos = _as_id_list(cfg.get("eos_token_id"))
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        for token_id in _as_id_list(_read_json(gen_path).get("eos_token_id")):
            if token_id not in eos:
                eos.append(token_id)

    attention_bias = bool(cfg.get("attention_bias", arch == GPT_OSS))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    softcap = cfg.get("final_logit_softcapping")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", path)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling if isinstance(scaling, RopeScaling) else None,
        rope_yarn=scaling if isinstance(scaling, YarnScaling) else None,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=sliding_window,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", is_gemma)),
        qkv_bias=is_qwen2 or attention_bias or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True))),
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM") or is_gemma,
        torch_dtype=_DTYPES[dtype_name],
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
        layer_windows=_layer_windows(cfg, arch, num_layers, sliding_window, path),
        hidden_act=activation,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5 if is_gemma else None,
        norm_unit_offset=is_gemma,
        embedding_scale=is_gemma,
        local_rope_theta=local_theta,
        rope_linear_factor=scaling if isinstance(scaling, float) else 1.0,
        final_logit_softcapping=None if softcap is None else float(softcap),
        gguf_file=top.get("gguf_file"),
        **_moe(cfg, arch, num_layers, path),
    )


# CPU flags (x86 /proc/cpuinfo "flags", ARM "Features") of bfloat16 arithmetic instructions: with
# one, "auto" runs the dense parts on the CPU in bfloat16 (half the bytes a step reads), else float32.
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags of /proc/cpuinfo's text (x86 "flags", ARM "Features" lines)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def cpu_auto_dtype(flags: frozenset[str]) -> torch.dtype:
    """What "auto" means on a CPU with these flags: bfloat16 where it has bf16 instructions."""
    return torch.bfloat16 if flags & BF16_CPU_FLAGS else torch.float32


def _this_cpu_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """"auto" means the checkpoint's dtype on an accelerator and, on the CPU, bfloat16 where it has
    bf16 instructions, else float32 (cpu_auto_dtype)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        return config.torch_dtype if device.type != "cpu" else cpu_auto_dtype(_this_cpu_flags())
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


def served_max_model_len(config: ModelConfig, max_model_len: int | None) -> int:
    """The longest sequence a runner of this model serves: `max_model_len` (None: as long as the
    model allows). A sliding window does not limit it: windowed layers attend their window only.
    ValueError if `max_model_len` exceeds the model's positions."""
    limit = config.max_position_embeddings
    if max_model_len is None:
        return limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit of {limit} tokens")
    return max_model_len


def resolve_device(device: str) -> str:
    """"auto" means CUDA where torch sees a device, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
