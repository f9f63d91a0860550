"""A tensor-parallel rank that reads no plan ring: it gets each plan from rank 0 by a broadcast in the
process group and runs it on its shard. The offline engine's ranks 1..N-1 are such ranks, and so are
the ranks of every machine but the head (`pipeline worker`).
"""
from __future__ import annotations

import json
from collections.abc import Callable
import signal

from stages.contracts.config import EngineConfig
from stages.gpu_runner.models.config import resolve_device
from stages.gpu_runner.parallel.group import PlanBroadcast, TensorParallel, join_group, leave_group
from stages.gpu_runner.runner import ModelRunner
from stages.messages import decode_plan

CONFIG_KEY = "engine_config"  # the head's EngineConfig as JSON, in the rendezvous store


def join_timeout_s(config: EngineConfig) -> float:
    """How long rank 0 waits for the others: half the start time, so that a missing rank is named
    before the daemon's own deadline for the stages to be ready passes."""
    return config.start_timeout_s / 2


def join(config: EngineConfig, rank: int, num_ring_readers: int,
         check: Callable[[], None] | None = None) -> TensorParallel:
    """Join the group of `config` as `rank` (its CUDA device: its place on this machine); rank 0
    calls `check` while it waits for the others (it raises if one of them is known dead), and
    publishes the config for other machines' workers (`CONFIG_KEY`)."""
    published = {CONFIG_KEY: json.dumps(config.to_dict())} if rank == 0 else None
    return join_group(rank, config.tensor_parallel_size, config.master_addr, config.master_port,
                      resolve_device(config.device), join_timeout_s(config),
                      local_rank=rank % config.ranks_per_node, num_ring_readers=num_ring_readers, check=check,
                      published=published, ranks_per_node=config.ranks_per_node)


def build_rank(config: EngineConfig, tp: TensorParallel) -> ModelRunner:
    runner = ModelRunner(config, tp=tp)
    runner.copy_to_host = False  # rank 0 alone hands the tokens on
    return runner


def serve_plans(runner: ModelRunner) -> None:
    """Run the plans rank 0 broadcasts until it says stop."""
    plans = PlanBroadcast(runner.tp.plan_group)
    while (payload := plans.receive()) is not None:
        runner.execute(decode_plan(payload))


def main(config_json: str, rank: int, num_ring_readers: int) -> None:
    """Process body of one such rank: join, load the shard, serve plans, leave."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0's owner decides when the group ends
    config = EngineConfig.from_dict(json.loads(config_json))
    tp = join(config, rank, num_ring_readers)
    try:
        serve_plans(build_rank(config, tp))
    finally:
        leave_group()
