"""The runner stage: executes the scheduler's step plans on the model and hands back sampled tokens.

The root holds the wiring: stage.py (the process), worker.py (a rank fed plans by broadcast),
build.py (the runner from the engine config), runner.py (one step: inputs, forward, sampling).
The rooms, each with its own map:
- inputs/: the persistent batch and each step's device inputs, static decode and its graphs;
- models/: the model families and their config; layers/: what families share, with the kernels
  of their norms and rotary (a new layer, such as a mixture of experts, lands here);
- attention/: the attention backends (torch, Triton, the CPU kernel) beside the paged KV cache;
- triton_kernels/ and cpu_ops/: the kernels by kind, behind the layer or backend that calls them
  (quantized matmuls land beside the others of their kind);
- loaders/: checkpoint formats (safetensors, GGUF) and filling a model from one;
- sampling/: the sampler and per-row constraints; speculative/: proposers and verification;
- parallel/: tensor parallelism's process group and the model's cut; simulated/: the benchmarks'
  simulated device.
"""
