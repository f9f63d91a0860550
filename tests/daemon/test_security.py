"""Security of a live daemon: private socket and shared memory, nothing from the socket unpickled
or evaluated, a client aborts only its own requests (and can abort those by id), and request ids
that cannot be guessed."""
from __future__ import annotations

import ast
import asyncio
import os
import pickle
import re
import socket
import stat
import threading
import time
from pathlib import Path

import msgspec
import pytest
from live_daemon import LiveDaemon, RawConnection, wait_idle
from test_bad_input import framed, read_replies

from pipeline.client import AsyncClient, Client
from pipeline.errors import RequestAborted
from pipeline.protocol import (
    Abort,
    Aborted,
    Accepted,
    Delta,
    Done,
    Error,
    Generate,
    encode_frame,
)
from pipeline.protocol import WireSamplingParams as Params
from shm.naming import SHM_DIR, new_instance_id, unlink_instance
from shm.segment import RingSegment
from shm.mailbox import create_mailbox
from stages.status import StatusBoard

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0.0}  # runs seconds unless aborted
NUM_REQUEST_IDS = 1000
PRIVATE = 0o600


def test_socket_directory_and_socket_are_private(live_daemon: LiveDaemon) -> None:
    directory = os.lstat(live_daemon.socket_path.parent)
    assert stat.S_ISDIR(directory.st_mode) and stat.S_IMODE(directory.st_mode) == 0o700
    assert directory.st_uid == os.getuid()
    sock = os.lstat(live_daemon.socket_path)
    assert stat.S_ISSOCK(sock.st_mode) and stat.S_IMODE(sock.st_mode) == PRIVATE


def test_shared_memory_segments_are_created_private() -> None:
    instance = new_instance_id()
    old_umask = os.umask(0)  # the modes must not depend on a umask that happens to be strict
    try:
        ring = RingSegment.create(instance, "security", 4096, num_readers=2)
        board = StatusBoard.create(instance)
        create_mailbox(instance, max_rows=4, logprob_width=4, num_consumers=2, cuda=False)
        entries = sorted(name for name in os.listdir(SHM_DIR) if instance in name)
        # The ring, its three doorbells (sem.*), the status board and the mailbox.
        assert len(entries) == 6, entries
        for name in entries:
            info = os.stat(os.path.join(SHM_DIR, name))
            assert (name, stat.S_IMODE(info.st_mode), info.st_uid) == (name, PRIVATE, os.getuid())
    finally:
        os.umask(old_umask)
        ring.close()
        board.close()
        unlink_instance(instance)


def test_a_running_daemon_has_no_shared_memory_open_to_others(live_daemon: LiveDaemon) -> None:
    # Segments unlink themselves once every end has attached, so few (if any) are left to look
    # at; whatever is left must be private.
    for name in live_daemon.shm_entries():
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == PRIVATE, name


class _Trap:
    """Unpickling this creates the file `path`: a side effect anyone could see."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.path), "w")


def test_nothing_from_the_socket_is_unpickled_or_evaluated(live_daemon: LiveDaemon, tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    trap = _Trap(marker)
    encode = msgspec.msgpack.Encoder().encode
    payloads = [
        *(pickle.dumps(trap, protocol) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)),
        pickle.dumps({"type": "generate", "prompt": trap}),
        encode({"type": "generate", "prompt": pickle.dumps(trap)}),  # pickle bytes as a field
        encode(msgspec.msgpack.Ext(1, pickle.dumps(trap))),  # msgpack extension types
        encode({"type": "generate", "prompt": "hi", "params": {"seed": msgspec.msgpack.Ext(2, b"\x00")}}),
        encode({"type": "abort", "request_id": msgspec.msgpack.Ext(3, b"id")}),
    ]
    for payload in payloads:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(live_daemon.socket_path))
            sock.sendall(framed(payload))
            replies, closed = read_replies(sock)
        assert closed and [(type(m), getattr(m, "code", None)) for m in replies] == [(Error, "protocol")]
    # Text that is code is only text: a prompt and a stop string, served as such.
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    with Client(live_daemon.socket_path, timeout_s=10) as client:
        completion = client.generate(code, {"max_tokens": 4, "temperature": 0.0, "stop": [code]})
        assert completion.finish_reason in ("stop", "length")
        assert client.health().status == "ok"
    assert not marker.exists()


def test_the_socket_side_never_imports_pickle_or_calls_eval() -> None:
    modules = ["pipeline/protocol.py", *sorted(f"pipeline/{package}/{path.name}" for package in ("serve", "client")
                                                for path in (REPO / "pipeline" / package).glob("*.py"))]
    assert "pipeline/serve/socket_connection.py" in modules and "pipeline/client/connection.py" in modules
    for module in modules:
        tree = ast.parse((REPO / module).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        called = {node.func.id for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert not imported & {"pickle", "marshal", "shelve", "dill", "cloudpickle"}, module
        assert not called & {"eval", "exec", "compile", "__import__"}, module


def test_a_client_can_abort_only_its_own_requests(live_daemon: LiveDaemon) -> None:
    owner, other = RawConnection(live_daemon.socket_path), RawConnection(live_daemon.socket_path)
    try:
        owner.send(Generate("a request that must not be stopped", Params(max_tokens=48, ignore_eos=True,
                                                                        temperature=0.0), stream=True))
        accepted = owner.receive()
        assert isinstance(accepted, Accepted)
        other.send(Abort(accepted.request_id))
        refused = other.receive()
        assert isinstance(refused, Error)
        assert (refused.code, refused.request_id) == ("not_found", accepted.request_id)
        with Client(live_daemon.socket_path, timeout_s=10) as client:
            assert client.abort(accepted.request_id) is False  # not this client's request
        token_ids: list[int] = []
        while not isinstance(message := owner.receive(), Done):
            assert isinstance(message, Delta), message  # never Error(aborted)
            token_ids.extend(message.token_ids)
        assert (message.finish_reason, len(token_ids)) == ("length", 48)
    finally:
        owner.close()
        other.close()


def request_ids_of_one_connection(socket_path: Path, count: int) -> list[str]:
    """Ids of `count` requests sent at once on one connection, each aborted once accepted."""
    ids: list[str] = []
    num_ended = num_abort_replies = 0
    raw = RawConnection(socket_path)
    try:
        raw.sock.sendall(encode_frame(Generate([5, 6], Params(max_tokens=1))) * count)
        while num_ended < count or num_abort_replies < count:
            message = raw.receive()
            if isinstance(message, Accepted):
                ids.append(message.request_id)
                raw.send(Abort(message.request_id))  # little work for the model
            elif isinstance(message, Done) or (isinstance(message, Error) and message.code == "aborted"):
                num_ended += 1
            else:  # the Abort's reply: Aborted, or not_found when the request had finished
                assert isinstance(message, Aborted) or (isinstance(message, Error) and message.code == "not_found")
                num_abort_replies += 1
    finally:
        raw.close()
    return ids


def test_request_ids_are_unique_and_unguessable(live_daemon: LiveDaemon) -> None:
    per_connection = NUM_REQUEST_IDS // 10
    ids = [i for _ in range(10) for i in request_ids_of_one_connection(live_daemon.socket_path, per_connection)]
    assert len(ids) == NUM_REQUEST_IDS == len(set(ids))
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)  # 64 random bits each
    values = [int(i, 16) for i in ids]
    # No counter or clock inside: successive ids go up about as often as down, differences differ,
    # every bit is a coin flip, and even the first four hex digits rarely repeat.
    num_up = sum(b > a for a, b in zip(values, values[1:]))
    assert 0.4 < num_up / (len(values) - 1) < 0.6
    assert len({b - a for a, b in zip(values, values[1:])}) == len(values) - 1
    for bit in range(64):
        assert 0.4 < sum((v >> bit) & 1 for v in values) / len(values) < 0.6, f"bit {bit}"
    assert len({i[:4] for i in ids}) > 950


def test_abort_by_id_from_another_thread_frees_the_request(live_daemon: LiveDaemon) -> None:
    with Client(live_daemon.socket_path, timeout_s=10) as client:
        stream = client.stream("abort me from another thread", LONG)
        results: list[bool] = []
        aborter = threading.Thread(target=lambda: results.append(client.abort(stream.request_id)))
        received = 0
        with pytest.raises(RequestAborted):
            for delta in stream:
                received += len(delta.token_ids)
                if received >= 3 and aborter.ident is None:
                    aborter.start()  # this thread goes on reading while the other aborts
        aborter.join(timeout=10)
        assert results == [True] and received >= 3

        # A generate waiting in another thread, found by its id and aborted.
        errors: list[BaseException] = []

        def blocked() -> None:
            try:
                client.generate("a generate that would run for seconds", LONG)
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                errors.append(exc)

        worker = threading.Thread(target=blocked)
        worker.start()
        deadline = time.monotonic() + 10
        while not client.running_request_ids():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        [request_id] = client.running_request_ids()
        assert client.abort(request_id) is True
        worker.join(timeout=10)
        assert [type(e) for e in errors] == [RequestAborted]
        assert client.generate("still serving", {"max_tokens": 2}).usage.completion_tokens >= 1
    wait_idle(live_daemon.socket_path, timeout_s=2.0)


def test_abort_by_id_from_another_task_frees_the_request(live_daemon: LiveDaemon) -> None:
    async def main() -> tuple[bool, int]:
        client = AsyncClient(live_daemon.socket_path)
        stream = client.stream("abort me from another task", LONG)
        started = asyncio.Event()
        received = 0

        async def read() -> None:
            nonlocal received
            async for delta in stream:
                received += len(delta.token_ids)
                if received >= 3:
                    started.set()

        reader = asyncio.ensure_future(read())
        await started.wait()
        assert stream.request_id is not None
        aborted = await client.abort(stream.request_id)
        with pytest.raises(RequestAborted):
            await reader
        return aborted, received

    aborted, received = asyncio.run(main())
    assert aborted is True and received >= 3
    wait_idle(live_daemon.socket_path, timeout_s=2.0)
