"""Runs the real daemon (`pipeline.daemon.run_daemon`) over the EngineThreadBackend test double.

Usage: python tests/daemon/serve_engine_thread.py --socket PATH [engine options of `pipeline start`]
"""
from __future__ import annotations

import argparse
import logging
import sys

from engine_thread_backend import EngineThreadBackend

from pipeline.cli import add_engine_options, engine_config
from pipeline.serve.daemon import run_daemon


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    add_engine_options(parser)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return run_daemon(engine_config(args), args.socket, EngineThreadBackend)


if __name__ == "__main__":
    sys.exit(main())
