"""A step's inputs: the persistent batch the plans update (input_batch.py), the plan's rows as arrays
(step_layout.py), the device inputs built from them in one upload (step_inputs.py), the bucketed
decode buffers and their CUDA graphs (static_decode.py, decode_graphs.py), and what a step hands
back (output.py)."""
