"""Speculative decoding in the runner: drafts proposed on the device, verified in the same step.

ngram.py, suffix.py (over stages/suffix_tree.py, on the host) and draft_model.py propose (proposer.py
says what a proposer is); rejection.py accepts or
rejects; speculator.py drives them within a step and keeps the one number the host learns a step
late: each row's rejected drafts. spec_inputs.py is what a speculative step adds to its inputs.
"""
