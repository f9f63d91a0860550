"""Imported first by every script in tools/: the checkout goes to the front of sys.path, tools/ to its end.

Python puts a script's own folder first on sys.path. There tools/profile.py would shadow the
standard library's `profile`, which cProfile imports and torch imports cProfile while it runs a
model, so every tool would fail inside torch. Moved to the end, tools/ still lets one tool import
another (bench_hf imports bench_e2e), and the checkout first lets the tools run without installing.
"""
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent
ROOT = TOOLS.parent
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() not in (TOOLS, ROOT)] + [str(TOOLS)]
