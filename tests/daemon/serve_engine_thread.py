"""Runs the real daemon (`pipeline.serve.daemon.run_daemon`) over a backend test double.

Usage: python tests/daemon/serve_engine_thread.py [--backend engine-thread|poisoned-tokenizer] --socket PATH
       [daemon and engine options of `pipeline start`]

engine-thread (the default): the in-process backend, whose engine thread dies on FAIL_PROMPT
(engine_thread_backend.py); poisoned-tokenizer: the stage processes, whose tokenizer workers die
on POISON_PROMPT (poisoned_tokenizer.py).
"""
from __future__ import annotations

import argparse
import logging
import sys

from engine_thread_backend import EngineThreadBackend
from poisoned_tokenizer import PoisonedStageBackend

from pipeline.options import add_daemon_options, add_engine_options, daemon_config, engine_config
from pipeline.serve.daemon import run_daemon

BACKENDS = {"engine-thread": EngineThreadBackend, "poisoned-tokenizer": PoisonedStageBackend}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="engine-thread", choices=sorted(BACKENDS))
    parser.add_argument("--socket", required=True)
    add_daemon_options(parser)
    add_engine_options(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_daemon(engine_config(args), args.socket, BACKENDS[args.backend], settings=daemon_config(args))


if __name__ == "__main__":
    sys.exit(main())
