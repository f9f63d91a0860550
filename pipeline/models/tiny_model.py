"""Small random HF-format checkpoints (config, safetensors, BPE tokenizer, chat template) for
tests, benchmarks and the daemon's embedded default model. The command line is
`tools/make_tiny_model.py`.

Everything is deterministic from the seed: the same command writes byte-identical weights and
the same tokenizer on any machine (the tokenizer's corpus is generated from text embedded here,
not read from the Python installation, whose sources differ between versions).
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "mixtral": ("MixtralForCausalLM", "mixtral"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gpt_oss": ("GptOssForCausalLM", "gpt_oss"),
}
# The mixtures' experts: count, top-k, each expert's intermediate size (Mixtral's is its
# intermediate_size), Qwen2-MoE's shared expert, and which layers keep a dense MLP; each family
# routes its own way (Mixtral always renormalises the top-k weights, Qwen2-MoE here does not).
MOE = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=False,
                      shared_expert_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=64, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[]),
}
# Gemma 3's tiny sliding window: prompts of the tests cross it many times.
GEMMA3_WINDOW = 16
# gpt-oss: its experts (stacked, see _gpt_oss_layer), a short sliding window on every other layer,
# YaRN over a short original context (2048 / 64 = its factor), and a SwiGLU limit low enough that the clamp binds.
GPT_OSS = dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=8, swiglu_alpha=1.702, swiglu_limit=3.0,
               attention_bias=True, router_aux_loss_coef=0.0, output_router_logits=False,
               rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 10000.0})

PRESETS: dict[str, dict[str, int]] = {
    # head_dim differs from hidden_size / num_heads on purpose, so explicit head_dim is exercised.
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                 intermediate_size=128, vocab_size=1024, max_position_embeddings=2048),
    # ~20M parameters: the benchmark model.
    "20m": dict(hidden_size=384, num_layers=12, num_heads=6, num_kv_heads=2, head_dim=64,
                intermediate_size=1024, vocab_size=2048, max_position_embeddings=4096),
    # Llama-3.2-1B's shapes (1.24B parameters, tied embeddings): the GPU benchmark's model. Its
    # tokenizer, trained on the small embedded corpus, has far fewer entries than the vocabulary.
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
               intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072),
}
# Presets whose lm_head is the embedding matrix, as in the model they copy (qwen2 always ties).
TIED_PRESETS = frozenset({"1b"})

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
# ChatML, the template of Qwen and many others, so the default model can serve chat. Its
# markers are plain text to this tokenizer (whose only special tokens are BOS and EOS): adding
# them as tokens would change the tokenizer, and a random model gains nothing from them.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a an of to in on for with by from at as is are was were be been being have has had do does did "
    "model token request batch block cache prefix decode prefill step plan row queue ring memory device "
    "host stream event kernel tensor layer head attention norm weight bias value key query position rotary "
    "scheduler runner sampler tokenizer detokenizer daemon client server socket process thread lock "
    "shared segment cursor record header payload length kind offset slot mailbox handle copy pinned "
    "fast slow small large first last next previous new old every each some many few all none "
    "read write send receive open close start stop wait signal wake sleep spin poll run execute "
    "python torch numpy array index gather scatter permute reshape view stride shape dtype float int "
    "river mountain forest ocean city village road bridge garden window door table chair lamp book "
    "morning evening night summer winter spring autumn rain snow wind cloud sun moon star light dark "
    "walk talk think write read sing dance build carry hold give take make find keep leave bring "
    "quick brown fox jumps over lazy dog while happy people gather around warm fire telling stories"
).split()
_PUNCT = [".", ",", "!", "?", ";", ":"]


def corpus(seed: int = 0, num_sentences: int = 4000) -> list[str]:
    """Deterministic pseudo-English lines with digits, code and punctuation, for BPE training."""
    rng = random.Random(seed)
    lines = []
    for i in range(num_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        words[0] = words[0].capitalize()
        if i % 7 == 0:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        if i % 11 == 0:
            words.append(f"{rng.choice(_WORDS)}_{rng.choice(_WORDS)}({rng.randint(0, 9)})")
        lines.append(" ".join(words) + rng.choice(_PUNCT))
    return lines


def train_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer with `vocab_size` entries at most; ids 0 and 1 are BOS and EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    return tokenizer


def _config(arch: str, sizes: dict[str, int], dtype: str, rope_scaling_llama3: bool, tied: bool) -> dict:
    architecture, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": sizes["hidden_size"],
        "intermediate_size": sizes["intermediate_size"],
        "num_hidden_layers": sizes["num_layers"],
        "num_attention_heads": sizes["num_heads"],
        "num_key_value_heads": sizes["num_kv_heads"],
        "head_dim": sizes["head_dim"],
        "hidden_act": "silu",
        "max_position_embeddings": sizes["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "vocab_size": sizes["vocab_size"],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if arch in ("llama", "qwen3", "qwen3_moe"):
        config["attention_bias"] = False
    if arch == "llama":
        config["mlp_bias"] = False
        if rope_scaling_llama3:
            # A short original context so the scaling changes most frequencies of a tiny model.
            config["rope_scaling"] = {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": max(64, sizes["max_position_embeddings"] // 8),
            }
    if arch == "mistral":
        config["sliding_window"] = None
    if arch == "gemma3":
        # Every other layer local; distinct local/global bases, linear scaling on the global
        # layers and a query scale apart from head_dim, so that mixing any of them up shows.
        del config["hidden_act"]
        config |= {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": sizes["head_dim"] // 2,
                   "sliding_window": GEMMA3_WINDOW, "rope_local_base_freq": 1000.0,
                   "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "attention_bias": False,
                   "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                   for i in range(sizes["num_layers"])],
                   "final_logit_softcapping": None, "attn_logit_softcapping": None}
    if arch == "gpt_oss":
        config |= GPT_OSS | {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                                             for i in range(sizes["num_layers"])]}
    if arch in MOE:
        config |= MOE[arch] | {"router_aux_loss_coef": 0.0, "output_router_logits": False}
    if arch == "mixtral":
        config |= {"sliding_window": None, "router_jitter_noise": 0.0}
    if arch == "qwen2_moe":
        config["qkv_bias"] = True
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = sizes["num_layers"]
    return config


def _weights(arch: str, sizes: dict[str, int], seed: int, dtype: torch.dtype, tied: bool,
             device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device).manual_seed(seed)

    def normal(*shape: int, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        values = torch.randn(*shape, generator=gen, device=device).mul_(std).add_(mean)
        return values.to(dtype).cpu()

    hidden, inter, head_dim = sizes["hidden_size"], sizes["intermediate_size"], sizes["head_dim"]
    q_size, kv_size = sizes["num_heads"] * head_dim, sizes["num_kv_heads"] * head_dim
    vocab = sizes["vocab_size"]
    # Wider spreads than a real model's 0.02: greedy decoding of a random model then has clear
    # winners (no near-ties that rounding could flip) and strong MLPs keep it from collapsing into
    # one repeated token, even with a tied head (which otherwise favours the current token).
    # Norm weights are not all ones, so a skipped norm changes the output.
    tensors = {"model.embed_tokens.weight": normal(vocab, hidden, std=0.3)}
    for i in range(sizes["num_layers"]):
        p = f"model.layers.{i}."
        # Gemma's norms scale by 1 + w: their weights sit around 0.
        norm_mean = 0.0 if arch == "gemma3" else 1.0
        norms = ["input_layernorm", "post_attention_layernorm"]
        if arch == "gemma3":
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for norm in norms:
            tensors[p + f"{norm}.weight"] = normal(hidden, std=0.1, mean=norm_mean)
        tensors[p + "self_attn.q_proj.weight"] = normal(q_size, hidden, std=0.1)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_size, hidden, std=0.1)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_size, hidden, std=0.1)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, q_size, std=0.05)
        if arch in ("qwen2", "qwen2_moe"):
            for name, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)):
                tensors[p + f"self_attn.{name}.bias"] = normal(size, std=0.1)
        if arch in ("qwen3", "gemma3", "qwen3_moe"):
            tensors[p + "self_attn.q_norm.weight"] = normal(head_dim, std=0.1, mean=norm_mean)
            tensors[p + "self_attn.k_norm.weight"] = normal(head_dim, std=0.1, mean=norm_mean)
        if arch == "gpt_oss":
            tensors |= _gpt_oss_layer(p, sizes, normal)
        elif arch in MOE and i not in MOE[arch].get("mlp_only_layers", ()):
            tensors |= _experts(arch, p, sizes, normal)
        else:
            tensors |= _mlp(p + "mlp.", ("gate_proj", "up_proj", "down_proj"), hidden, inter, normal)
    tensors["model.norm.weight"] = normal(hidden, std=0.1, mean=0.0 if arch == "gemma3" else 1.0)
    if not tied:
        tensors["lm_head.weight"] = normal(vocab, hidden, std=0.1)
    return tensors


def _mlp(prefix: str, names: tuple[str, str, str], hidden: int, inter: int, normal) -> dict[str, torch.Tensor]:
    gate, up, down = names
    return {prefix + f"{gate}.weight": normal(inter, hidden, std=0.5),
            prefix + f"{up}.weight": normal(inter, hidden, std=0.5),
            prefix + f"{down}.weight": normal(hidden, inter, std=0.5)}


def _experts(arch: str, p: str, sizes: dict[str, int], normal) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts, one tensor per expert projection as published checkpoints store them."""
    moe, hidden = MOE[arch], sizes["hidden_size"]
    mixtral = arch == "mixtral"
    prefix = p + ("block_sparse_moe." if mixtral else "mlp.")
    num_experts = moe["num_local_experts" if mixtral else "num_experts"]
    inter = sizes["intermediate_size"] if mixtral else moe["moe_intermediate_size"]
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    # A wide router: each token's choice of experts is clear, never a near-tie that rounding could flip.
    tensors = {prefix + "gate.weight": normal(num_experts, hidden, std=0.5)}
    for e in range(num_experts):
        tensors |= _mlp(prefix + f"experts.{e}.", names, hidden, inter, normal)
    if "shared_expert_intermediate_size" in moe:
        tensors |= _mlp(prefix + "shared_expert.", ("gate_proj", "up_proj", "down_proj"), hidden,
                        moe["shared_expert_intermediate_size"], normal)
        tensors[prefix + "shared_expert_gate.weight"] = normal(1, hidden, std=0.5)
    return tensors


def _gpt_oss_layer(p: str, sizes: dict[str, int], normal) -> dict[str, torch.Tensor]:
    """gpt-oss's attention biases and sinks, its router (with a bias) and its experts stacked as
    transformers saves them: gate_up_proj [E, H, 2I] (gate and up interleaved), down_proj [E, I, H]."""
    hidden, inter, experts = sizes["hidden_size"], sizes["intermediate_size"], GPT_OSS["num_local_experts"]
    q_size, kv_size = sizes["num_heads"] * sizes["head_dim"], sizes["num_kv_heads"] * sizes["head_dim"]
    tensors = {p + f"self_attn.{name}.bias": normal(size, std=0.1)
               for name, size in (("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size), ("o_proj", hidden))}
    tensors[p + "self_attn.sinks"] = normal(sizes["num_heads"], std=1.0)
    mlp = p + "mlp."
    return tensors | {mlp + "router.weight": normal(experts, hidden, std=0.5), mlp + "router.bias": normal(experts, std=0.5),
                      mlp + "experts.gate_up_proj": normal(experts, hidden, 2 * inter, std=0.5),
                      mlp + "experts.gate_up_proj_bias": normal(experts, 2 * inter, std=0.1),
                      mlp + "experts.down_proj": normal(experts, inter, hidden, std=0.5),
                      mlp + "experts.down_proj_bias": normal(experts, hidden, std=0.1)}


def _save_shards(tensors: dict[str, torch.Tensor], outdir: Path, num_shards: int) -> None:
    if num_shards == 1:
        save_file(tensors, str(outdir / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    total_bytes = 0
    for shard in range(num_shards):
        filename = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        save_file(part, str(outdir / filename), metadata={"format": "pt"})
        for name, tensor in part.items():
            weight_map[name] = filename
            total_bytes += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (outdir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny_model(
    outdir: str | Path,
    arch: str,
    seed: int = 0,
    *,
    preset: str = "tiny",
    shards: int = 1,
    dtype: str = "float32",
    rope_scaling_llama3: bool = False,
    device: str = "cpu",
    **sizes: int,
) -> Path:
    """Write the checkpoint into `outdir` (created if needed) and return its path.

    `sizes` overrides the preset's hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
    intermediate_size, vocab_size or max_position_embeddings. `device` is where the random
    weights are drawn ("cuda" makes the 1b preset in seconds); the same seed draws other values on
    another device type, so the weights are deterministic per seed and device type.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    unknown = set(sizes) - set(PRESETS[preset])
    if unknown:
        raise ValueError(f"unknown size names {sorted(unknown)}; known: {sorted(PRESETS[preset])}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    resolved = {**PRESETS[preset], **{k: v for k, v in sizes.items() if v is not None}}
    if resolved["num_heads"] % resolved["num_kv_heads"]:
        raise ValueError(f"num_heads {resolved['num_heads']} is not a multiple of num_kv_heads {resolved['num_kv_heads']}")

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(resolved["vocab_size"], seed=0)
    if tokenizer.get_vocab_size() > resolved["vocab_size"]:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, more than vocab_size {resolved['vocab_size']}")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": resolved["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN}, indent=2))
    # Gemma 3 ties its head; the tiny one does not: a random tied Gemma repeats one token, and
    # its tied path is tested on the real checkpoint.
    tied = arch == "qwen2" or preset in TIED_PRESETS
    config = _config(arch, resolved, dtype, rope_scaling_llama3, tied)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1], "do_sample": False}, indent=2))
    _save_shards(_weights(arch, resolved, seed, getattr(torch, dtype), tied, device), out, shards)
    return out
