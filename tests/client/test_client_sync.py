"""The blocking Client against the FakeDaemon test double."""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from fake_daemon import FakeDaemon

from pipeline.client import Client, Connection, RequestReplies, make_generate
from pipeline.errors import (
    ConnectionLost,
    DaemonNotRunning,
    InvalidRequest,
    Overloaded,
    PipelineError,
    PromptTooLong,
    ProtocolError,
    RequestAborted,
    RequestNotFound,
    StageFailed,
)
from pipeline.protocol import Abort, Accepted, Delta, Error, FrameDecoder, Generate, ServerMessage, encode_frame
from stages.contracts.params import InvalidParams, SamplingParams

pytestmark = pytest.mark.timeout(20)

ENDLESS = {"max_tokens": 10**9}
ERROR_CLASSES = {
    "invalid_params": InvalidRequest,
    "prompt_too_long": PromptTooLong,
    "overloaded": Overloaded,
    "stage_failed": StageFailed,
    "aborted": RequestAborted,
    "not_found": RequestNotFound,
    "protocol": ProtocolError,
}


def test_generate_returns_the_completion(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        completion = client.generate("héllo 中文", {"max_tokens": 100})
        assert completion.text == "héllo 中文"
        assert completion.token_ids == [ord(c) for c in "héllo 中文"]
        assert completion.prompt_token_ids == completion.token_ids
        assert completion.finish_reason == "stop"
        assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (8, 8)
        assert len(completion.request_id) == 16

        cut = client.generate([1, 2, 3, 4], SamplingParams(max_tokens=2))
        assert (cut.text, cut.token_ids, cut.finish_reason) == ("bc", [1, 2], "length")
    sent = daemon.messages_of(Generate)
    assert [m.stream for m in sent] == [False, False]  # type: ignore[attr-defined]
    assert sent[1].params.max_tokens == 2  # type: ignore[attr-defined]


def test_stream_deltas_concatenate_to_the_text(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        stream = client.stream("streamed 😀 text", {"max_tokens": 100})
        assert stream.finish_reason is None
        deltas = list(stream)
        assert len(deltas) == len("streamed 😀 text")
        assert "".join(d.text for d in deltas) == "streamed 😀 text"
        assert stream.finish_reason == "stop"
        assert stream.completion is not None
        assert stream.completion.text == client.generate("streamed 😀 text", {"max_tokens": 100}).text
        assert stream.completion.token_ids == [t for d in deltas for t in d.token_ids]


def test_breaking_out_of_a_stream_aborts_the_request(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        stream = client.stream("endless", ENDLESS)
        for i, delta in enumerate(stream):
            assert delta.text == "e"
            if i == 2:
                break
        assert daemon.wait_until(lambda d: stream.request_id in d.aborted_by_disconnect)
        assert stream.request_id not in daemon.finished
        assert client.health().status == "ok"  # the client itself still works


def test_closing_the_client_aborts_its_open_streams(daemon: FakeDaemon) -> None:
    client = Client(daemon.socket_path)
    streams = [client.stream("endless", ENDLESS) for _ in range(2)]
    assert client.health().status == "ok"
    client.close()
    ids = {s.request_id for s in streams}
    assert daemon.wait_until(lambda d: ids <= d.aborted_by_disconnect)
    assert not daemon.finished


def wait_for_running_request(client: Client, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (ids := client.running_request_ids()):
        assert time.monotonic() < deadline, "the request was never accepted"
        time.sleep(0.001)
    return ids[0]


def test_abort_by_id_from_another_thread_ends_the_stream_with_request_aborted(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        stream = client.stream("endless", ENDLESS)
        assert client.running_request_ids() == [stream.request_id]
        results: list[bool] = []
        aborter = threading.Thread(target=lambda: results.append(client.abort(stream.request_id)))
        with pytest.raises(RequestAborted) as excinfo:
            for i, _ in enumerate(stream):
                if i == 2:
                    aborter.start()  # this thread goes on reading while the other aborts
        aborter.join(timeout=10)
        assert results == [True]
        assert excinfo.value.request_id == stream.request_id
        assert daemon.aborted_by_message == {stream.request_id}  # by the Abort, not a disconnect
        assert client.running_request_ids() == []
        assert client.abort(stream.request_id) is False  # no longer running: not even sent
        assert client.abort("0123456789abcdef") is False
    assert len(daemon.messages_of(Abort)) == 1


def test_abort_of_a_generate_blocked_in_another_thread(daemon: FakeDaemon) -> None:
    errors: list[BaseException] = []
    with Client(daemon.socket_path) as client:

        def blocked_generate() -> None:
            try:
                client.generate("endless", ENDLESS)  # the fake never answers this one
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                errors.append(exc)

        worker = threading.Thread(target=blocked_generate)
        worker.start()
        request_id = wait_for_running_request(client)
        assert client.abort(request_id) is True
        worker.join(timeout=10)
        assert [type(e) for e in errors] == [RequestAborted]
        assert daemon.aborted_by_message == {request_id} and not daemon.aborted_by_disconnect
        # The generate ran on the client's shared connection, which still works.
        assert client.generate("after the abort").text == "after the abort"


def test_a_client_cannot_abort_another_clients_request(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client, Client(daemon.socket_path) as other:
        stream = client.stream("endless", {"max_tokens": 50})
        assert other.abort(stream.request_id) is False  # not its request: nothing is sent
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:  # past the client library
            raw.connect(str(daemon.socket_path))
            raw.sendall(encode_frame(Abort(stream.request_id)))
            decoder: FrameDecoder[ServerMessage] = FrameDecoder(ServerMessage)
            while (reply := decoder.next_message()) is None:
                decoder.feed(raw.recv(4096))
        assert isinstance(reply, Error) and (reply.code, reply.request_id) == ("not_found", stream.request_id)
        assert len(list(stream)) == 50 and stream.finish_reason == "length"  # ran to completion
        assert not daemon.aborted_by_message


def test_stream_abort_before_reading_keeps_what_had_arrived(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        stream = client.stream("endless", ENDLESS)
        assert stream.abort() is True  # from the thread that owns the stream, before any read
        with pytest.raises(RequestAborted):
            for delta in stream:
                assert delta.text == "e"
        assert stream.abort() is False


def test_an_abort_reply_that_arrives_after_the_request_does_not_confuse_the_next(daemon: FakeDaemon) -> None:
    connection = Connection(daemon.socket_path, timeout_s=10)
    try:
        replies = RequestReplies()
        connection.send(make_generate("first", None, stream=False))
        while not replies.done:
            replies.on_message(connection.receive())
        assert connection.abort(str(replies.request_id)) is False  # finished: not_found, set aside
        connection.send(make_generate("second", None, stream=True))
        assert isinstance(connection.receive(), Accepted)
        assert isinstance(connection.receive(), Delta)
    finally:
        connection.close()


@pytest.mark.parametrize("code", sorted(ERROR_CLASSES))
def test_each_error_code_raises_its_exception(daemon: FakeDaemon, code: str) -> None:
    with Client(daemon.socket_path) as client:
        with pytest.raises(ERROR_CLASSES[code]) as excinfo:
            client.generate(f"error:{code}")
        if code == "invalid_params":
            assert excinfo.value.field == "temperature"  # type: ignore[attr-defined]
        with pytest.raises(ERROR_CLASSES[code]):
            client.stream(f"error:{code}")
        stream = client.stream(f"late-error:{code}")
        with pytest.raises(ERROR_CLASSES[code]) as excinfo:
            list(stream)
        assert excinfo.value.request_id == stream.request_id
        with pytest.raises(ERROR_CLASSES[code]):
            client.generate(f"late-error:{code}")
        assert client.generate("still fine").text == "still fine"


def test_unknown_error_code_is_still_a_pipeline_error(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client, pytest.raises(PipelineError, match="teapot"):
        client.generate("error:teapot")


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("hi", {"temperature": -1.0}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"temprature": 0.5}, "temprature"),
        ("hi", SamplingParams(max_tokens=4, min_tokens=2), None),
        ("", None, "prompt"),
        ([1, -2], None, "prompt"),
        (b"bytes", None, "prompt"),
    ],
)
def test_invalid_requests_fail_before_a_round_trip(
    daemon: FakeDaemon, prompt: object, params: object, field: str | None
) -> None:
    if field is None:  # a valid object changed after construction
        params.max_tokens = 1  # type: ignore[attr-defined]
        field = "min_tokens"
    with Client(daemon.socket_path) as client:
        for call in (client.generate, client.stream):
            with pytest.raises(InvalidRequest) as excinfo:
                call(prompt, params)  # type: ignore[arg-type]
            assert excinfo.value.field == field
            assert isinstance(excinfo.value, InvalidParams)
    assert daemon.received == []


def test_invalid_params_message_names_the_allowed_range(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client, pytest.raises(InvalidRequest, match=r"\[0.0, 100.0\], got 150"):
        client.generate("hi", {"temperature": 150})


def test_daemon_not_running_names_the_socket_path(socket_dir: Path) -> None:
    missing = socket_dir / "none.sock"
    with pytest.raises(DaemonNotRunning, match=str(missing)):
        Client(missing).generate("hi")
    stale = socket_dir / "stale.sock"  # a socket file nobody listens on
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))
    listener.close()
    with pytest.raises(DaemonNotRunning, match=str(stale)) as excinfo:
        Client(stale).stream("hi")
    assert excinfo.value.socket_path == stale


def test_health_and_stats(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        health = client.health()
        assert (health.status, health.stages) == ("ok", {"scheduler": "running"})
        stream = client.stream("endless", ENDLESS)
        assert client.stats().num_running_requests == 1
        stream.close()
        assert daemon.wait_until(lambda d: stream.request_id in d.aborted_by_disconnect)


def test_client_reconnects_after_the_daemon_restarts(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        assert client.generate("one").text == "one"
        daemon.stop()
        with pytest.raises(DaemonNotRunning):
            client.generate("two")
        daemon.start()
        assert client.generate("three").text == "three"


def test_daemon_closing_mid_request_raises_connection_lost(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        stream = client.stream("endless", ENDLESS)
        daemon.stop()
        with pytest.raises(ConnectionLost):
            for _ in stream:
                pass


def test_garbage_from_the_daemon_raises_protocol_error(daemon: FakeDaemon) -> None:
    with Client(daemon.socket_path) as client:
        with pytest.raises(ProtocolError, match="invalid message"):
            client.generate("garbage")
        assert client.generate("after").text == "after"  # on a fresh connection


def test_concurrent_threads_share_one_client(daemon: FakeDaemon) -> None:
    results: dict[int, str] = {}
    with Client(daemon.socket_path) as client:

        def work(i: int) -> None:
            for j in range(5):
                results[i * 10 + j] = client.generate(f"t{i}-{j}").text

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results == {i * 10 + j: f"t{i}-{j}" for i in range(4) for j in range(5)}


def test_raw_protocol_error_reply(daemon: FakeDaemon) -> None:
    # What a client speaking bad bytes gets back: Error(protocol), then the daemon hangs up.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.connect(str(daemon.socket_path))
        raw.sendall(b"\xff\xff\xff\xff")
        reply = b""
        while chunk := raw.recv(4096):
            reply += chunk
    assert b"protocol" in reply and b"exceeds" in reply
    assert not daemon.messages_of(Abort)


def test_stream_batches_takes_params_for_all_prompts_or_one_each_and_names_a_mismatch(socket_dir: Path) -> None:
    client = Client(socket_dir / "unused.sock")  # nothing is sent before the loop starts
    batches = client.stream_batches([[1], [2]], [{"max_tokens": 3}, {"max_tokens": 4}])
    assert [g.params.max_tokens for g in batches._generates] == [3, 4]
    assert [g.params.max_tokens for g in client.stream_batches([[1], [2]], {"max_tokens": 5})._generates] == [5, 5]
    with pytest.raises(InvalidRequest, match="one per prompt: 1 params for 2 prompts"):
        client.stream_batches([[1], [2]], [{"max_tokens": 3}])
    with pytest.raises(InvalidRequest, match="max_tokens"):
        client.stream_batches([[1], [2]], [{"max_tokens": 3}, {"max_tokens": -1}])
