"""Profiling parts in one process: phase ranges in a torch.profiler capture, the status board's profile
request and answers, the daemon's ProfileControl, and the trace directory checks."""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from pipeline.errors import InvalidRequest, StageFailed
from pipeline.engine.profiling import ProfileControl, check_trace_directory
from stages.profiling import StageProfiler
from stages.status import PROFILE_DIRECTORY_BYTES, ProfileAnswer, ProfileOutcome, StatusBoard

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "traces"
    directory.mkdir(mode=0o700)
    return directory


def annotations(path: Path) -> list[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return [event["name"] for event in events if event.get("cat") == "user_annotation"]


def test_phases_appear_in_the_capture_only_while_it_runs(private_dir: Path) -> None:
    profiler = StageProfiler("runner")
    step, forward = profiler.range("step"), profiler.range("forward")
    assert profiler.range("step") is step  # one object per name: a loop fetches it once
    with step:  # no capture: the range must not need one
        pass
    with step:
        profiler.start(private_dir)  # a capture starting inside a phase (a tick in a blocked write)
    assert profiler.capturing
    for _ in range(3):
        with step:
            with forward:
                pass
    with step:
        path = profiler.stop()  # and one stopping inside a phase
    assert path == private_dir / "runner.json" and not profiler.capturing
    names = annotations(path)
    # The phase the capture started in is not recorded; the one it stopped in may be, cut short.
    assert names.count("forward") == 3 and 3 <= names.count("step") <= 4
    with step:  # after the capture: still usable, records nothing
        pass
    assert profiler.stop() is None


def test_a_trace_that_cannot_be_written_is_a_failed_answer_not_a_crash(board: StatusBoard, tmp_path: Path) -> None:
    profiler = StageProfiler("detokenizer")
    gone = tmp_path / "gone"
    gone.mkdir()
    board.profile.request(str(gone))
    assert profiler.answer(board.profile.current()).outcome == ProfileOutcome.STARTED
    gone.rmdir()
    generation = board.profile.request(None)
    answer = profiler.answer(board.profile.current())
    assert answer.generation == generation and answer.outcome == ProfileOutcome.FAILED
    assert str(gone) in answer.message
    assert not profiler.capturing
    assert profiler.answer(board.profile.current()).outcome == ProfileOutcome.NOT_CAPTURING


def test_the_board_carries_requests_and_each_stages_answer(board: StatusBoard) -> None:
    assert board.profile.generation() == 0 and not board.profile.active
    directory = "/tmp/ünïcode traces"
    generation = board.profile.request(directory)
    request = board.profile.current()
    assert (request.generation, request.directory, board.profile.active) == (generation, directory, True)
    board.profile.answer(3, ProfileAnswer(generation, ProfileOutcome.FAILED, "é" * 2000))  # cut to fit
    answer = board.profile.answer_of(3)
    assert answer.generation == generation and answer.outcome == ProfileOutcome.FAILED
    assert answer.message and set(answer.message) == {"é"}
    assert board.profile.answer_of(2).outcome == ProfileOutcome.NONE
    stop = board.profile.request(None)
    assert stop == generation + 1 and board.profile.current().directory is None and not board.profile.active
    with pytest.raises(ValueError, match="at most"):
        board.profile.request("/" + "d" * PROFILE_DIRECTORY_BYTES)


def test_profile_control_gathers_every_live_stage(board: StatusBoard, private_dir: Path) -> None:
    """The control runs on a worker thread, as in the daemon; this thread plays the runner's loop
    (torch allows one capture per process, so one stage here). Stage 1 is dead: not waited for."""
    control = ProfileControl(board, lambda: {0: "runner"}, timeout_s=10)
    profiler = StageProfiler("runner")
    results: list[object] = []

    def run_control() -> None:
        try:
            control.start(str(private_dir))
            results.append(profiler.capturing)
            results.append(control.stop())
        except Exception as exc:  # noqa: BLE001 - asserted below
            results.append(exc)

    seen = board.profile.generation()
    thread = threading.Thread(target=run_control)
    thread.start()
    while thread.is_alive():  # the loop's tick
        if board.profile.generation() != seen:
            request = board.profile.current()
            seen = request.generation
            board.profile.answer(0, profiler.answer(request))
        thread.join(0.002)
    assert results == [True, [str(private_dir / "runner.json")]]
    assert annotations(private_dir / "runner.json") == []  # valid JSON; no phase ran


def test_profile_control_names_the_stages_that_do_not_answer(board: StatusBoard, private_dir: Path) -> None:
    control = ProfileControl(board, lambda: {0: "runner", 1: "scheduler"}, timeout_s=0.2)
    with pytest.raises(StageFailed, match=r"\['runner', 'scheduler'\] did not answer the profile start request"):
        control.start(str(private_dir))
    assert not board.profile.active  # a failed start leaves no capture wanted


def test_profile_control_reports_a_stage_that_could_not_start(board: StatusBoard, private_dir: Path) -> None:
    generation = board.profile.generation()

    def refuse() -> None:
        while board.profile.generation() == generation:
            time.sleep(0.001)
        board.profile.answer(0, ProfileAnswer(board.profile.generation(), ProfileOutcome.FAILED, "no torch here"))

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    control = ProfileControl(board, lambda: {0: "tokenizer0"}, timeout_s=0.5)
    with pytest.raises(StageFailed, match="could not start in tokenizer0: no torch here"):
        control.start(str(private_dir))
    thread.join()
    assert not board.profile.active


def test_trace_directory_checks(tmp_path: Path, private_dir: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(private_dir)
    assert check_trace_directory(str(link)) == str(private_dir)  # the stages write where it was checked
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o775)
    for directory, reason in [("traces", "absolute path"), (str(tmp_path / "none"), "does not exist"),
                              (str(open_dir), "mode 0775")]:
        with pytest.raises(InvalidRequest, match=reason):
            check_trace_directory(directory)
