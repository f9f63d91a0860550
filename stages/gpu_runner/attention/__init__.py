"""Attention in the runner: the backends that write KV into the paged cache and attend, beside the cache.

interface.py says what a backend is (and the window arithmetic every one shares); selector.py
picks one. torch_backend.py (with torch_metadata.py, and cpu_attention.py for the compiled CPU
kernel) is the plain-torch backend, the CPU product path; triton_backend.py runs the kernels of
triton_kernels/. kv_cache.py sizes and allocates the paged cache; kv_offload.py keeps blocks in a
host-memory pool for the offload connector.
"""
