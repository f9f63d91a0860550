"""`pipeline worker`: the tensor-parallel ranks of a machine other than the head.

The worker reads the head's engine config from the rendezvous store that the head's rank 0
serves (torch.distributed's TCPStore at --master-addr:--master-port), spawns this machine's
ranks, which join the group and run the plans rank 0 broadcasts, and waits for them. When the
group ends (the daemon stopped or restarts its stages after a failure) it waits for the next
one at the same address: a worker serves every restart of the head until it is interrupted.
"""
from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import time
from typing import NoReturn

from pipeline.errors import PipelineError
from stages.contracts.config import EngineConfig
from stages.gpu_runner import worker
from stages.gpu_runner.parallel.group import RankJoinError, read_published

log = logging.getLogger("pipeline.serve.worker")

# One wait for the head's rendezvous, then another: short, since a signal is seen only between
# two (the wait is torch's, in C++).
HEAD_WAIT_S = 2.0
RETRY_S = 1.0


def node_config(head: EngineConfig, model: str, nnodes: int, node_rank: int) -> EngineConfig:
    """The head's config as this machine runs it: its own copy of the model, its own node rank."""
    if head.nnodes != nnodes:
        raise PipelineError(f"--nnodes {nnodes} differs from the head's nnodes {head.nnodes}")
    if node_rank >= nnodes:
        raise PipelineError(f"--node-rank {node_rank} must be below --nnodes {nnodes}")
    return EngineConfig.from_dict({**head.to_dict(), "model": model, "node_rank": node_rank})


def run_ranks(config: EngineConfig) -> list[int]:
    """Spawn this machine's ranks of `config` and wait until all have ended; their exit codes."""
    context = multiprocessing.get_context("spawn")
    spec = json.dumps(config.to_dict())
    first = config.node_rank * config.ranks_per_node
    processes = [context.Process(target=worker.main, args=(spec, rank, config.ranks_per_node),
                                 name=f"pipeline-rank{rank}")
                 for rank in range(first, first + config.ranks_per_node)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [process.exitcode for process in processes]


def run_node(model: str, nnodes: int, node_rank: int, master_addr: str, master_port: int) -> NoReturn:
    """Serve the head's groups one after another, until interrupted (SIGINT or SIGTERM)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_signal)  # a stopped worker takes its ranks with it
    waiting = False
    while True:
        try:
            head = EngineConfig.from_dict(json.loads(read_published(master_addr, master_port, worker.CONFIG_KEY,
                                                                    HEAD_WAIT_S)))
        except RankJoinError:
            if not waiting:
                log.info("waiting for the head at %s:%d", master_addr, master_port)
                waiting = True
            time.sleep(RETRY_S)
            continue
        waiting = False
        config = node_config(head, model, nnodes, node_rank)
        log.info("node %d: running ranks %d..%d of %d for the head at %s:%d", node_rank,
                 node_rank * config.ranks_per_node, (node_rank + 1) * config.ranks_per_node - 1,
                 config.tensor_parallel_size, master_addr, master_port)
        codes = run_ranks(config)
        log.info("the group ended (rank exit codes %s); waiting for the head's next one", codes)
        time.sleep(RETRY_S)  # the head's old rendezvous goes with its rank 0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
