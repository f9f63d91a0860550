"""The engine's configuration, validated once, and the model limits the runner publishes.

`EngineConfig` is the one shape of every engine setting: the CLI, `LLM(...)`, the daemon's
backend and every stage read the same fields (stages get it as JSON and rebuild it with
`EngineConfig.from_dict`). `ModelLimits` is what only the loaded model can tell.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
import socket
from pathlib import Path

from stages.contracts.speculative import SpeculativeConfig

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "bfloat16", "float16", "float32")
# none: every weight dequantized to the dtype at load; gguf: a GGUF file's block-quantized weights
# kept as blocks and multiplied in place, on the CPU (on CUDA they are still dequantized at load);
# q8_0, q4_0: float weights quantized to those ggml blocks at load as well (CPU); auto: gguf for a
# GGUF file on the CPU where the kernels are built, else none (stages/gpu_runner/loaders/quantization.py).
QUANTIZATIONS = ("auto", "none", "gguf", "q8_0", "q4_0")
WHOLE_WEIGHT_QUANTIZATIONS = ("gguf", "q8_0", "q4_0")  # weights held whole: no tensor parallelism
# auto: the dense parts' dtype; bfloat16 on the CPU halves the pool (keys and values widened to
# float32 as they are read, the arithmetic unchanged).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
# How quantized weights (CPU) multiply a decode step's few activation rows: float32 keeps every product
# within float32 rounding of the dequantized weights'; int8 quantizes each 32 activations to 8 bits
# and dots in integers (AVX-512 VNNI or AVX2; every block type the kernels take), faster and within the
# activations' rounding, which moves near-ties of greedy decoding.
QUANTIZED_ACTIVATIONS = ("float32", "int8")
KV_CONNECTORS = ("offload",)
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: triton on CUDA (blocks it can tile), else torch
CPU_PLACEMENTS = ("auto", "split", "shared")  # stages/process.py stage_cores
# `pipeline start`'s step token budget for a model on the CPU: there a step of 8192 prompt tokens
# holds every stream's first token back while it runs, and 2048 fill the cores as well
# (tools/bench/bench_peer.py: the 20M Llama at 64 streams, TTFT p50 1.2 s against 2.0 s, tok/s 1416
# against 1316; SmolLM2 bfloat16 at 32 streams, TTFT p50 1.6 s against 2.4 s, tok/s 426 against 425).
CPU_MAX_NUM_BATCHED_TOKENS = 2048
TOKENIZER_FILE = "tokenizer.json"
MIN_MAILBOX_SLOTS = 3  # two steps in flight (async) plus the one being written
MAX_TOKENIZERS = 32
MAX_SIMULATED_MS = 60_000.0


def check_positive(name: str, value: object) -> int:
    """`value` if it is an int >= 1, else ValueError naming `name` and the value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass(slots=True)
class EngineConfig:
    """How the engine runs. Every field is checked when the config is made."""

    model: str = ""  # checkpoint directory ("" only where a ready-made runner is given to LLM)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: the checkpoint's on CUDA; on CPU bfloat16 given bf16 instructions, else float32
    quantization: str = "auto"  # QUANTIZATIONS
    quantized_activations: str = "float32"  # QUANTIZED_ACTIVATIONS
    max_num_seqs: int = 256  # batch rows: requests holding KV at once
    max_model_len: int | None = None  # prompt + outputs of one request; None: the model's, bounded by the KV pool
    max_num_batched_tokens: int = 8192  # tokens computed per step, all rows together
    # (`pipeline start` takes CPU_MAX_NUM_BATCHED_TOKENS for a model on the CPU unless told)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: as many as kv_cache_memory_bytes holds
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on CPU, most of the free memory on CUDA
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES
    num_tokenizers: int = 1  # tokenizer worker processes
    async_scheduling: bool = True  # plan step N+1 while step N runs
    enable_prefix_caching: bool = True
    kv_connector: str | None = None  # None | "offload"
    kv_offload_num_blocks: int | None = None  # the offload connector's host pool; None: as many as the device's
    seed: int | None = None  # the runner's generator, for unseeded sampling
    mailbox_slots: int = 8  # token mailbox slots: more than the steps that can be in flight
    attention_backend: str = "auto"  # auto | torch | triton (auto: triton on CUDA where it takes the block size)
    enforce_eager: bool = False  # never capture CUDA graphs; decode runs eagerly on CUDA too
    # Where stages run when the model runs on the CPU (stages/process.py stage_cores): split (the
    # runner on all cores but one, the other stages on that one), shared (the runner on every core,
    # the others wherever the OS puts them), auto (split from SPLIT_MIN_CORES cores on).
    cpu_placement: str = "auto"
    start_timeout_s: float = 300.0  # how long the stages may take to load the model and get ready
    # Tensor parallelism: runner ranks of one torch.distributed group (gloo on CPU, NCCL on CUDA),
    # spread over `nnodes` machines; this one is `node_rank` (0: the head, which runs the daemon).
    tensor_parallel_size: int = 1
    # A mixture of experts' whole experts placed on the ranks (each rank num_experts / N of them)
    # instead of every expert split across them; attention stays tensor-parallel.
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # the rendezvous: rank 0's machine
    master_port: int = 0  # 0: a free port picked at start (one machine only)
    # Benchmarks only (tools/bench/bench_overhead.py), not a device: no model runs; each step takes this
    # many ms of wall time on a simulated device (stages/gpu_runner/simulated/). None: the model.
    simulated_device_ms: float | None = None
    simulated_device_trace: str | None = None  # where the simulated device records each step's times
    # Speculative decoding (stages/contracts/speculative.py): vLLM's keys as a JSON object; None: off.
    speculative_config: dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str):
            raise ValueError(f"model must be a checkpoint directory path (str), got {self.model!r}")
        _check_choice("device", self.device, DEVICES)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("quantization", self.quantization, QUANTIZATIONS)
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("quantized_activations", self.quantized_activations, QUANTIZED_ACTIVATIONS)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("cpu_placement", self.cpu_placement, CPU_PLACEMENTS)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_tokenizers", "mailbox_slots",
                     "tensor_parallel_size", "nnodes"):
            check_positive(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "kv_offload_num_blocks"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must leave room for a prompt token and an output, got {self.max_model_len}")
        if self.num_tokenizers > MAX_TOKENIZERS:
            raise ValueError(f"num_tokenizers must be at most {MAX_TOKENIZERS}, got {self.num_tokenizers}")
        if self.mailbox_slots < MIN_MAILBOX_SLOTS:
            raise ValueError(f"mailbox_slots must be at least {MIN_MAILBOX_SLOTS} (the steps that can be in flight "
                             f"plus one), got {self.mailbox_slots}")
        for name in ("async_scheduling", "enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.kv_connector is not None:
            _check_choice("kv_connector", self.kv_connector, KV_CONNECTORS)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.start_timeout_s, bool) or not isinstance(self.start_timeout_s, (int, float)) \
                or not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be positive, got {self.start_timeout_s!r}")
        self._check_simulated_device()
        self._check_tensor_parallel()
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)
            if self.simulated_device_ms is not None:
                raise ValueError("speculative_config needs a model: the simulated device proposes no drafts")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative config (None: speculation off)."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def num_speculative_tokens(self) -> int:
        """Drafts verified per speculating row and step (0: speculation off)."""
        return 0 if self.speculative_config is None else self.speculative.num_speculative_tokens

    def _check_tensor_parallel(self) -> None:
        if self.quantization in WHOLE_WEIGHT_QUANTIZATIONS and self.tensor_parallel_size > 1:
            raise ValueError(f"quantization {self.quantization} holds each weight whole on one rank: it does not "
                             f"run with tensor_parallel_size {self.tensor_parallel_size}; use quantization none")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} must be a multiple of nnodes "
                             f"{self.nnodes} (the same number of ranks on every machine)")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes {self.nnodes}), got {self.node_rank!r}")
        if isinstance(self.master_port, bool) or not isinstance(self.master_port, int) \
                or not 0 <= self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port number (0: pick a free one), got {self.master_port!r}")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError(f"nnodes {self.nnodes} needs a master_port every machine knows, got 0")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"master_addr must be a host name or address, got {self.master_addr!r}")
        if self.tensor_parallel_size > 1 and self.kv_connector is not None:
            raise ValueError(f"kv_connector {self.kv_connector!r} is not supported with tensor_parallel_size "
                             f"{self.tensor_parallel_size}")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def with_rendezvous_port(self) -> EngineConfig:
        """This config, with a free local port for the ranks' rendezvous when master_port is 0."""
        if self.master_port != 0 or self.tensor_parallel_size == 1:
            return self
        with socket.socket() as sock:
            sock.bind((self.master_addr, 0))
            port = sock.getsockname()[1]
        return EngineConfig.from_dict({**self.to_dict(), "master_port": port})

    def _check_simulated_device(self) -> None:
        ms = self.simulated_device_ms
        if ms is not None and (isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 < ms < MAX_SIMULATED_MS):
            raise ValueError(f"simulated_device_ms must be a number of ms in (0, {MAX_SIMULATED_MS}), got {ms!r}")
        trace = self.simulated_device_trace
        if trace is not None and (not isinstance(trace, str) or not trace or ms is None):
            raise ValueError(f"simulated_device_trace must be a file path, given with simulated_device_ms; got "
                             f"{trace!r} with simulated_device_ms {ms!r}")

    @property
    def tokenizer_path(self) -> Path:
        return Path(self.model) / TOKENIZER_FILE

    def to_dict(self) -> dict[str, object]:
        """The config as JSON-able values (how a stage process receives it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> EngineConfig:
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})


@dataclass(slots=True)
class ModelLimits:
    """What the runner learns when it loads the model, and the other stages need."""

    num_kv_blocks: int
    max_model_len: int  # bounded by the KV pool as well as the model
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    num_host_blocks: int = 0  # the KV connector's host pool (0 without one)
    # Sliding windows. The KV cache is one or two groups of layers, each with its block pool and
    # block tables: group 0 (num_kv_blocks) attends `window` tokens back (0: all of them); a
    # model mixing global and local layers (Gemma 3) has group 1, its local layers, with
    # num_window_blocks blocks and `local_window`. A block wholly out of its group's window is
    # released.
    window: int = 0
    local_window: int = 0
    num_window_blocks: int = 0
    # The runner's CPU kernels (stages/gpu_runner/cpu_ops): "built (torch ops, avx512)", or "plain
    # torch (no compiler)" and why; "" where the model is not on the CPU.
    cpu_kernels: str = ""
    runs_in: str = ""  # what each part runs in (weights, dense dtype, KV cache), for the log and status
    # c0 / c1 of a step of N tokens costing c0 + c1 * N, as the runner measured it at start-up with
    # speculative decoding on: how many extra tokens cost as much as the step itself (None: not measured).
    verify_free_tokens: float | None = None
    # A draft model's decode step over n rows costs as much as e0 + e1 * n of the target's tokens
    # verified: (e0, e1), measured with verify_free_tokens ((0, 0): no draft model, or not measured).
    draft_step_tokens: tuple[float, float] = (0.0, 0.0)
    # Both fitted at a few batch sizes: (rows, F, e0, e1), fewest rows first; the scheduler interpolates
    # between them (empty: the two above hold for every batch).
    verify_costs_by_batch: tuple[tuple[float, float, float, float], ...] = ()
