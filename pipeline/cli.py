"""The `pipeline` command: start, stop, status and generate against the daemon's socket."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from pipeline.client import Client
from pipeline.errors import DaemonNotRunning, PipelineError
from pipeline.options import (HelpFormatter, add_daemon_options, add_engine_options, add_rank_options, daemon_config,
                              engine_config, port, positive_int, resolved_model, seconds)
from pipeline.paths import default_socket_path
from stages.contracts.params import InvalidParams

DETACH_READY_TIMEOUT_S = 300.0  # building the default model and spawning the stages
STOP_MARGIN_S = 30.0  # `stop` waits the daemon's grace period and this much more for it to exit
POLL_S = 0.1


def _socket_path(args: argparse.Namespace) -> Path:
    return Path(args.socket) if args.socket else default_socket_path()


def _worker(args: argparse.Namespace) -> int:
    """Run this machine's tensor-parallel ranks for the head's daemon until they end."""
    from pipeline.serve.worker import run_node

    if args.node_rank == 0:
        raise PipelineError("--node-rank 0 is the head: run `pipeline start` there, `pipeline worker` elsewhere")
    model = resolved_model(args.model)
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
    from pipeline.engine.multiprocess import StageBackend

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
    if stats.runs_in:
        print(f"  {stats.runs_in}")
    if stats.cpu_kernels:
        print(f"  CPU kernels: {stats.cpu_kernels}")
    if health.reason:
        print(f"  why: {health.reason}")
    print(f"stages: instance {health.instance or '-'}, {health.num_restarts} restarts"
          + (f"; last failure: {health.last_failure}" if health.last_failure else ""))
    for name, state in health.stages.items():
        print(f"  {name}: {state}")
    print(f"recovery: {stats.num_resumed_requests} requests resumed after stage restarts, "
          f"{stats.num_guard_failed_requests} failed by the poison guard")
    print(f"faults: {stats.num_stage_deaths} stage deaths, {stats.num_stall_verdicts} stall verdicts "
          f"(a live stage taken for hung; nothing restarts for one)")
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
        chat = not args.raw and client.stats().chat_template  # a chat model answers a question asked as a chat
        messages = [{"role": "user", "content": args.prompt}]
        if args.stream:
            with client.stream_chat(messages, params) if chat else client.stream(args.prompt, params) as stream:
                for delta in stream:
                    sys.stdout.write(delta.text)
                    sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            print((client.chat(messages, params) if chat else client.generate(args.prompt, params)).text)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from pipeline.chat.terminal import run_chat

    return run_chat(args, _socket_path(args))


def add_router_options(parser: argparse.ArgumentParser) -> None:
    from pipeline.router.main import RouterConfig
    from pipeline.router.policy import Policy

    defaults = RouterConfig([], "")
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a daemon's HTTP API, http://host:port (repeat for each replica)")
    parser.add_argument("--port", type=port, default=defaults.port, help="TCP port (default %(default)s)")
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
    parser.add_argument("--health-interval", type=seconds, default=defaults.health_interval_s,
                        help="seconds between health checks of each backend (default %(default)s)")
    parser.add_argument("--stall-timeout-s", type=seconds, default=defaults.stall_timeout_s,
                        help="the least time a backend under a silent stream has to show a sign of life: its "
                             "deadline is the larger of this and 10 of its learned gaps between frames; its /health "
                             "is asked halfway, an ok answer means slow and the wait goes on, no sign of life for a "
                             "whole deadline takes it for hung and the stream goes on on another "
                             "(default %(default)s)")
    parser.set_defaults(handler=_router)


def _router(args: argparse.Namespace) -> int:
    from pipeline.router.main import RouterConfig, run
    from pipeline.router.policy import Policy

    model = resolved_model(args.model)
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
    parser = argparse.ArgumentParser(prog="pipeline", description="LLM serving engine daemon and client",
                                     formatter_class=HelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def with_socket(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sub.add_argument("--socket", help=f"the daemon's Unix socket (default: {default_socket_path()})")
        return sub

    start = with_socket(commands.add_parser("start", help="start the daemon (in the foreground unless --detach)"))
    add_engine_options(start)
    add_daemon_options(start)
    start.add_argument("--detach", action="store_true", help="run in the background; return once it serves")
    start.add_argument("--nsys", action="store_true",
                       help="run under `nsys launch` (Nsight Systems must be on PATH) so that "
                            "tools/profiling/profile_daemon.py can record an .nsys-rep of the running daemon: "
                            "nsys cannot attach to one started without it")
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
    generate.add_argument("prompt", help="the text; a chat model gets it as the user's message (see --raw)")
    generate.add_argument("--raw", action="store_true",
                          help="send the prompt as it is, without the model's chat template")
    generate.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most")
    generate.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                          "whose probabilities add up to this")
    generate.add_argument("--top-k", type=int, default=0, help="sample among this many likeliest tokens (0: all)")
    generate.add_argument("--seed", type=int, default=None,
                          help="random seed of this request's sampling (default: a fresh one)")
    generate.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    generate.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    generate.add_argument("--stream", action="store_true", help="print text as it is generated")
    generate.set_defaults(handler=_generate)
    chat = with_socket(commands.add_parser(
        "chat", help="chat with the model in the terminal (starts a daemon if none runs)",
        description="Chat with the daemon's model; if no daemon runs on the socket, one is started for the chat "
                    "and stopped when it ends. Lines from a pipe are messages too. /help lists the commands."))
    chat.add_argument("--model", default=None, help="the checkpoint directory or GGUF file of a daemon the chat "
                      "starts (default: SmolLM2-135M-Instruct)")
    chat.add_argument("--keep", action="store_true", help="leave a daemon the chat started running at its end")
    chat.add_argument("--system", default=None, help="the system prompt (default: none)")
    chat.add_argument("--temperature", type=float, default=0.2,
                      help="sampling temperature (0: greedy; the default model's card advises 0.2)")
    chat.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling's probability mass")
    chat.add_argument("--max-tokens", type=positive_int, default=512, help="tokens per answer at most")
    chat.set_defaults(handler=_chat)
    add_router_options(commands.add_parser("router", help="an OpenAI-compatible HTTP front that routes requests "
                                           "to several daemons' --port APIs, with failover between them"))
    # Listed for --help only: main() hands `bench` and its arguments to pipeline.serve_bench.
    commands.add_parser("bench", add_help=False, help="load a running daemon and report latency percentiles "
                        "(see `pipeline bench --help`)")
    for sub in commands.choices.values():
        sub.formatter_class = HelpFormatter
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
