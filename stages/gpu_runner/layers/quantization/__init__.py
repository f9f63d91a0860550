"""Linear methods: how a linear layer's weight is held and multiplied. base.py (the interface and
the quantized weight), dense.py (a float weight, oneDNN on the CPU), gguf.py (GGUF blocks kept as
the file stores them, CPU kernels in cpu_ops/quant.c); layers/linear.py picks one per weight."""
