"""Checkpoint formats in, named tensors (and a tokenizer) out: safetensors and GGUF. A loader knows formats, not architectures."""
