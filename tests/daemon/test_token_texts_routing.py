"""The daemon routes a step's plain events (`TokenTexts`) as it routes events: a Delta per
streamed request, text kept for the others, tokens recorded for a resume, none for a request
that is gone."""
from __future__ import annotations

import numpy as np
import pytest
from fake_stage_backend import FakeBackend, RecordingConnection

from pipeline.protocol import Delta, Done, Generate
from pipeline.serve.server import DaemonServer
from pipeline.serve.socket_connection import handle_message
from stages.contracts.config import EngineConfig
from stages.contracts.outputs import OutputEvent, TokenTexts

pytestmark = pytest.mark.timeout(30)


def texts(req_ids: list[int], token_ids: list[int], pieces: list[str]) -> TokenTexts:
    encoded = [p.encode("utf-8") for p in pieces]
    return TokenTexts(np.array(req_ids, np.int64), np.array(token_ids, np.int32),
                      np.frombuffer(b"".join(encoded), np.uint8), np.cumsum([len(e) for e in encoded]))


def test_plain_batches_become_deltas_and_the_last_event_ends_each_request() -> None:
    server = DaemonServer(FakeBackend(EngineConfig(model="unused"), "1_a"), max_num_seqs=4)
    streamed, unary, gone = RecordingConnection(), RecordingConnection(), RecordingConnection()
    handle_message(server, streamed, Generate(prompt=[5, 6], stream=True))  # req_id 0
    handle_message(server, unary, Generate(prompt=[5, 6]))  # req_id 1
    handle_message(server, gone, Generate(prompt=[5, 6], stream=True))  # req_id 2
    server.drop_connection(gone)
    first = [OutputEvent(r, "a", np.array([7], np.int32), prompt_token_ids=np.array([5, 6], np.int32))
             for r in (0, 1)]
    server.on_events([*first, texts([0, 2, 1], [8, 8, 9], ["é", "x", " b"]), texts([1, 0], [3, 4], ["c", "中"])])
    server.on_events([OutputEvent(r, "", np.zeros(0, np.int32), finish_reason="length") for r in (0, 1)])

    deltas = [m for m in streamed.sent if isinstance(m, Delta)]
    assert [(d.text, d.token_ids) for d in deltas] == [("a", [7]), ("é", [8]), ("中", [4])]
    done = streamed.sent[-1]
    assert isinstance(done, Done) and done.usage.completion_tokens == 3
    unary_done = unary.sent[-1]
    assert isinstance(unary_done, Done) and (unary_done.text, unary_done.token_ids) == ("a bc", [7, 9, 3])
    assert not [m for m in gone.sent if isinstance(m, Delta)]
    assert server.num_generated_tokens == 6


def test_a_merged_batch_gives_each_request_one_delta_with_all_its_tokens() -> None:
    server = DaemonServer(FakeBackend(EngineConfig(model="unused"), "1_a"), max_num_seqs=4)
    streamed, unary = RecordingConnection(), RecordingConnection()
    handle_message(server, streamed, Generate(prompt=[5, 6], stream=True))  # req_id 0
    handle_message(server, unary, Generate(prompt=[5, 6]))  # req_id 1
    server.on_events([OutputEvent(r, "", np.zeros(0, np.int32), prompt_token_ids=np.array([5, 6], np.int32))
                      for r in (0, 1)])
    merged = TokenTexts(np.array([1, 0], np.int64), np.array([9, 3, 8, 4, 2], np.int32),
                        np.frombuffer("bcé中!".encode(), np.uint8), np.array([2, 8]), np.array([2, 5]))
    server.on_events([merged])
    server.on_events([OutputEvent(r, "", np.zeros(0, np.int32), finish_reason="length") for r in (0, 1)])

    deltas = [m for m in streamed.sent if isinstance(m, Delta)]
    assert [(d.text, d.token_ids) for d in deltas] == [("é中!", [8, 4, 2])]
    unary_done = unary.sent[-1]
    assert isinstance(unary_done, Done) and (unary_done.text, unary_done.token_ids) == ("bc", [9, 3])
    assert server.num_generated_tokens == 5


def test_pieces_of_every_width_and_empty_ones_split_where_their_bytes_do() -> None:
    server = DaemonServer(FakeBackend(EngineConfig(model="unused"), "1_a"), max_num_seqs=8)
    connections = [RecordingConnection() for _ in range(5)]
    for connection in connections:
        handle_message(server, connection, Generate(prompt=[5, 6], stream=True))
    server.on_events([OutputEvent(r, "", np.zeros(0, np.int32), prompt_token_ids=np.array([5, 6], np.int32))
                      for r in range(5)])
    pieces = ["", "🙂a", "x", "", "é中"]  # a partial character shows nothing; 4-, 1-, 2- and 3-byte ones
    server.on_events([texts(list(range(5)), [10, 11, 12, 13, 14], pieces)])
    for r, connection in enumerate(connections):
        assert [(d.text, d.token_ids) for d in connection.sent if isinstance(d, Delta)] == [(pieces[r], [10 + r])]
