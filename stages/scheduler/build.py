"""Building the scheduler from the engine config and the limits of the loaded model."""
from __future__ import annotations

from stages.contracts.config import EngineConfig, ModelLimits
from stages.scheduler.offload import OffloadConnectorScheduler
from stages.scheduler.scheduler import Scheduler


def build_scheduler(config: EngineConfig, limits: ModelLimits) -> Scheduler:
    """The scheduler as `LLM`, the in-process backend and the scheduler stage build it (with the
    offload connector's index when `config.kv_connector` asks for it)."""
    connector = OffloadConnectorScheduler(limits.num_host_blocks) if config.kv_connector == "offload" else None
    return Scheduler(config, limits, connector)
