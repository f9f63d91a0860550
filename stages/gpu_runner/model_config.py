"""The model's shape and options, read from a checkpoint directory's config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded: the message names the file, tensor or setting at fault."""


# HF architecture name -> per-family switches (see ModelConfig).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class RopeScaling:
    """Llama 3 frequency-dependent rope scaling; the only scaling supported."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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


def _rope(cfg: dict, path: Path) -> tuple[float, RopeScaling | None]:
    # transformers 4 writes rope_theta + rope_scaling; transformers 5 writes rope_parameters.
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ModelLoadError(f"{path}: rope scaling type {rope_type!r} is not supported (only 'llama3')")
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


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parse config.json (and generation_config.json for EOS ids) of a local checkpoint."""
    root = Path(model_dir)
    if not root.is_dir():
        raise ModelLoadError(f"model directory not found: {root}")
    path = root / "config.json"
    cfg = _read_json(path)
    architectures = cfg.get("architectures") or []
    arch = architectures[0] if architectures else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")

    hidden = int(_require(cfg, "hidden_size", path))
    num_heads = int(_require(cfg, "num_attention_heads", path))
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(f"{path}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    theta, scaling = _rope(cfg, path)

    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ModelLoadError(f"{path}: torch_dtype {dtype_name!r} is not supported; use one of {sorted(_DTYPES)}")

    sliding_window = cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
        sliding_window = None

    eos = _as_id_list(cfg.get("eos_token_id"))
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        for token_id in _as_id_list(_read_json(gen_path).get("eos_token_id")):
            if token_id not in eos:
                eos.append(token_id)

    attention_bias = bool(cfg.get("attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", path)),
        num_layers=int(_require(cfg, "num_hidden_layers", path)),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        sliding_window=None if sliding_window is None else int(sliding_window),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        torch_dtype=_DTYPES[dtype_name],
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
    )


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig, device: torch.device) -> torch.dtype:
    """"auto" means the checkpoint's dtype on an accelerator and float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        return config.torch_dtype if device.type != "cpu" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {dtype!r}")
    return _DTYPES[dtype]


def served_max_model_len(config: ModelConfig, max_model_len: int | None) -> int:
    """The longest sequence a runner of this model serves: `max_model_len` (None: as long as the
    model allows). Beyond a sliding window the model attends differently; the runner keeps full
    attention, so it stays exact by never running past the window. ValueError if it would."""
    limit = config.max_position_embeddings
    if config.sliding_window is not None:
        limit = min(limit, config.sliding_window)
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
