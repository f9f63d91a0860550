"""Checkpoint formats in, named tensors (and a tokenizer) out: safetensors and GGUF. A loader knows formats, not
architectures; loader.py builds the model for a checkpoint and fills it from one."""
