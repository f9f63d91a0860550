"""pipeline: an LLM serving engine whose stages run as separate processes."""
from pipeline.sampling_params import InvalidParams, SamplingParams

__all__ = ["InvalidParams", "SamplingParams"]
