"""The offline engine's tensor-parallel ranks: rank 0 in this process, ranks 1..N-1 spawned, each fed
every plan by rank 0's broadcast in the process group (stages/gpu_runner/worker.py)."""
from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import torch

from stages.contracts.config import EngineConfig
from stages.gpu_runner import worker
from stages.gpu_runner.parallel.group import RankJoinError, TensorParallel, leave_group

STOP_WAIT_S = 10.0


class WorkerRanks:
    """Spawns ranks 1..N-1 of `config` (whose master_port is set) and joins the group as rank 0."""

    def __init__(self, config: EngineConfig) -> None:
        if config.nnodes != 1:
            raise ValueError(f"the offline engine runs on one machine; nnodes must be 1, got {config.nnodes}")
        context = multiprocessing.get_context("spawn")
        spec = json.dumps(config.to_dict())
        self.processes: list[BaseProcess] = [
            context.Process(target=worker.main, args=(spec, rank, 1), name=f"pipeline-rank{rank}", daemon=True)
            for rank in range(1, config.tensor_parallel_size)]
        for process in self.processes:
            process.start()
        # Joining gives this process its share of the cores (parallel.use_local_device): the
        # caller's own setting comes back on close.
        self._num_threads = torch.get_num_threads()
        try:
            self.tp: TensorParallel = worker.join(config, 0, 1, check=self._check_alive)
        except BaseException:
            self._kill()
            torch.set_num_threads(self._num_threads)
            raise
        self.closed = False

    def _check_alive(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                raise RankJoinError(f"tensor-parallel rank {rank} exited with code {process.exitcode} before "
                                    f"joining the group")

    def close(self, stop_plans: Callable[[], None]) -> None:
        """Tell the ranks to stop (`stop_plans()`: rank 0's plan broadcast), wait for them, leave the group."""
        if self.closed:
            return
        self.closed = True
        try:
            stop_plans()
        finally:
            for process in self.processes:
                process.join(STOP_WAIT_S)
            self._kill()
            leave_group()
            torch.set_num_threads(self._num_threads)

    def _kill(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
