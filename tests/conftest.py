"""Fixtures for every test: a test session must leave /dev/shm as it found it; `--device` chooses
where the engine, daemon, HTTP and recovery tests run their engines (device_choice.py); `board` is
a status board of its own, unlinked at once. Property tests draw the same examples every run."""
from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from device_choice import DEVICE_ENV, DEVICES
from hypothesis import settings

from shm.naming import check_instance_id, instance_of, list_entries, new_instance_id, pid_alive, unlink_instance
from stages.status import StatusBoard

# Deterministic property tests: examples derived from each test, none kept between runs.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device", choices=DEVICES, default="cpu",
                     help="the device of the engines the engine, daemon, HTTP and recovery tests start (default "
                          "cpu); with cuda and no CUDA device those tests skip")


REFERENCE_USERS = {"tests/daemon/test_real_models.py::": "serving", "tests/gpu_runner/test_gguf_tokenizer.py::": "tokenizers"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that wait on transformers' references run last (their own order kept), so the
    reference worker, which starts when the session has collected them and runs at the lowest
    priority, has the whole run to compute them: run first (as pytest-xdist may hand them out),
    they sit waiting on a worker the busy tests leave no CPU to. Every xdist worker collects, and
    so orders, the same way."""
    users = [item for item in items if item.nodeid.startswith(tuple(REFERENCE_USERS))]
    if users:
        chosen = set(map(id, users))
        items[:] = [item for item in items if id(item) not in chosen] + users


def pytest_collection_finish(session: pytest.Session) -> None:
    """The CPU operators are built (once per machine and source, about a minute) before any test's
    time limit runs, so the first test to use them is not timed with the compiler. When tests that
    compare with transformers on the real checkpoints are collected, the references they need start
    at once, in a worker at the lowest priority (real_models.py). A session that only collects
    (--collect-only) runs no test and needs neither."""
    if session.config.option.collectonly:
        return
    if session.items and os.environ.get("PIPELINE_CPU_KERNELS", "1") != "0":
        from stages.gpu_runner import cpu_ops

        cpu_ops.library()  # a failed build is kept for the kernel tests, which then fail naming it
    kinds = {kind for prefix, kind in REFERENCE_USERS.items() if any(item.nodeid.startswith(prefix)
                                                                    for item in session.items)}
    if os.environ.get("PIPELINE_TEST_BACKEND", "real") != "real":
        kinds.discard("serving")
    if kinds:
        from real_models import start_references

        try:
            start_references(*sorted(kinds))
        except pytest.skip.Exception:
            pass  # a model's package is missing: its tests skip and say how to install it


def pytest_sessionfinish(session: pytest.Session) -> None:
    from real_models import stop_references

    stop_references()


FAILURE_LOG_ENV = "PIPELINE_TEST_FAILURE_LOG"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With PIPELINE_TEST_FAILURE_LOG set, each failure's report is appended to that file as it
    happens (once, by the controller under pytest-xdist): a run stopped by a time limit (the GPU
    check's phases) still says why its failed tests failed."""
    path = os.environ.get(FAILURE_LOG_ENV)
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a") as log:
        log.write(f"===== {report.nodeid} ({report.when}, {report.duration:.1f} s)\n{report.longreprtext}\n")
        for name, text in report.sections:
            if "stderr" in name or "log" in name:
                log.write(f"----- {name}\n{text[-4000:]}\n")


def pytest_configure(config: pytest.Config) -> None:
    os.environ[DEVICE_ENV] = config.getoption("device")
    # Which rows draft must not depend on how fast the machine is at the moment a runner starts:
    # drafts are taken as free (the runner's measurement has tests of its own, which unset this).
    os.environ.setdefault("PIPELINE_VERIFY_FREE_TOKENS", "none")


def _made_here(entry: str) -> bool:
    """Made by this session: its creator is this process, or a process (a child) that is gone.
    Entries of another live session running beside this one are not ours to judge."""
    creator = check_instance_id(instance_of(entry))
    return creator == os.getpid() or not pid_alive(creator)


@pytest.fixture
def board() -> Iterator[StatusBoard]:
    board = StatusBoard.create(new_instance_id())
    board.unlink()  # the mapping stays; nothing is left in /dev/shm
    yield board
    board.close()


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory() -> Iterator[None]:
    before = list_entries()
    yield
    leaked = sorted(entry for entry in list_entries() - before if _made_here(entry))
    for instance in {instance_of(entry) for entry in leaked}:
        unlink_instance(instance)  # reported below; no need to leave them for the next run
    if leaked:
        pytest.fail(f"tests left {len(leaked)} shared-memory entries in /dev/shm: {', '.join(leaked)}",
                    pytrace=False)
