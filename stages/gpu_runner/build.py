"""Building the runner from the engine config, and the model limits it tells the other stages."""
from __future__ import annotations

from stages.contracts.config import EngineConfig, ModelLimits
from stages.gpu_runner import cpu_ops
from stages.gpu_runner.attention.kv_offload import OffloadConnectorWorker
from stages.gpu_runner.parallel.group import TensorParallel
from stages.gpu_runner.runner import ModelRunner
from stages.gpu_runner.simulated.device import SimulatedDeviceRunner


def build_runner(config: EngineConfig, tp: TensorParallel | None = None) -> ModelRunner | SimulatedDeviceRunner:
    """The model runner as `LLM`, the in-process backend and the runner stage build it (the
    simulated device instead when a benchmark asks for one: `config.simulated_device_ms`); under
    tensor parallelism (`tp`) this rank's runner."""
    if config.simulated_device_ms is not None:
        if tp is not None:
            raise ValueError("the simulated device runs no model to split: tensor_parallel_size must be 1")
        return SimulatedDeviceRunner(config)
    worker = OffloadConnectorWorker(config.kv_offload_num_blocks) if config.kv_connector == "offload" else None
    return ModelRunner(config, kv_connector=worker, tp=tp)


def serving_max_model_len(runner_max_model_len: int, num_kv_blocks: int, block_size: int,
                          max_model_len: int | None) -> int:
    """The longest sequence served: the KV pool bounds a sequence as much as the model does."""
    if max_model_len is not None:
        return max_model_len
    return min(runner_max_model_len, num_kv_blocks * block_size)


def model_limits(runner: ModelRunner | SimulatedDeviceRunner, config: EngineConfig) -> ModelLimits:
    """What the scheduler and tokenizers need of the loaded model."""
    worker = runner.kv_connector
    return ModelLimits(
        num_kv_blocks=runner.num_kv_blocks,
        max_model_len=serving_max_model_len(runner.max_model_len, runner.num_kv_blocks, config.block_size,
                                            config.max_model_len),
        vocab_size=runner.vocab_size, eos_token_ids=runner.eos_token_ids,
        num_host_blocks=0 if worker is None else worker.num_host_blocks, **window_limits(runner),
        runs_in=getattr(runner, "runs_in", ""), **cost_limits(runner), cpu_kernels=cpu_kernels(runner))


def cost_limits(runner: object) -> dict[str, object]:
    """The ModelLimits fields of what drafts cost on the runner's device (none measured: free)."""
    costs = getattr(runner, "step_costs", None)
    if costs is None:
        return {}
    return {"verify_free_tokens": costs.free_tokens, "draft_step_tokens": costs.draft_step,
            "verify_costs_by_batch": costs.by_batch}


def cpu_kernels(runner: object) -> str:
    """What the runner's CPU kernels are (cpu_ops.describe()), "" for a model not on the CPU."""
    device = getattr(runner, "device", None)
    return cpu_ops.describe() if device is not None and device.type == "cpu" else ""


def window_limits(runner: object) -> dict[str, int]:
    """The ModelLimits fields of the runner's KV groups (none for a runner without windows)."""
    windows = getattr(runner, "kv_group_windows", (None,))
    return {"window": windows[0] or 0, "local_window": windows[1] if len(windows) > 1 else 0,
            "num_window_blocks": getattr(runner, "num_window_blocks", 0)}
