"""Fixtures for the ring tests."""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Iterator

import pytest

from shm.naming import new_instance_id, unlink_instance

StartChild = Callable[..., mp.process.BaseProcess]


@pytest.fixture
def instance() -> Iterator[str]:
    """A fresh instance id; whatever a test leaves under it is unlinked afterwards."""
    instance_id = new_instance_id()
    yield instance_id
    unlink_instance(instance_id)


@pytest.fixture
def start_child() -> Iterator[StartChild]:
    """start_child(target, *args) starts `target(*args)` in a 'spawn'ed process; every child
    still running when the test ends is killed, and all are reaped."""
    ctx = mp.get_context("spawn")
    started: list[mp.process.BaseProcess] = []

    def start(target: Callable[..., None], *args: object) -> mp.process.BaseProcess:
        child = ctx.Process(target=target, args=args, daemon=True)
        child.start()
        started.append(child)
        return child

    yield start
    for child in started:
        if child.exitcode is None:
            child.kill()
        child.join(5)
