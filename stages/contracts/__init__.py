"""What the stages and the product agree on: params, plans, outputs, config, error codes, links.

Every module here imports the standard library and numpy only (torch for type checking), so any
process (the client included) may import them without loading the model stack.
"""
