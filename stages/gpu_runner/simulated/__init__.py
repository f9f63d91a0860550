"""A simulated device for benchmarks: the runner's host work with the model replaced by a timeline
(device.py), and the step-named tokens and timeline file it writes (steps.py)."""
