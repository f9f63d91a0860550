"""Binary layouts: a header plus raw arrays round-trip through a ring, decoded without copies."""
from __future__ import annotations

import numpy as np
import pytest

from shm.codec import Layout
from shm.ring import RingWriter
from shm.ring_reader import RingReader
from shm.segment import RingSegment

STEP = Layout(
    "step",
    header=[("step", "q"), ("num_rows", "i"), ("num_new_blocks", "i"), ("temperature", "d"), ("last", "?")],
    arrays=[("rows", "int32", "num_rows"), ("new_block_ids", "int32", "num_new_blocks"),
            ("logprobs", "float32", "num_rows")],
)


def pair(instance: str, link: str) -> tuple[RingWriter, RingReader]:
    writer = RingWriter(RingSegment.create(instance, link, 1 << 16))
    return writer, RingReader.attach(writer.name)


@pytest.mark.timeout(10)
def test_header_and_arrays_round_trip_through_a_ring_as_read_only_views(instance: str) -> None:
    writer, reader = pair(instance, "codec")
    rows = np.array([4, 0, 7], np.int32)
    blocks = np.arange(5, dtype=np.int32) * 3  # 20 bytes: the next array starts on a padded offset
    logprobs = np.array([-0.5, -1.25, -3.0], np.float32)
    STEP.write(writer, 7, {"step": 1 << 40, "temperature": 0.7, "last": True},
               {"rows": rows, "new_block_ids": blocks, "logprobs": logprobs})
    record = reader.read(1.0)
    assert record.kind == 7
    message = STEP.decode(record.payload)
    assert (message["step"], message["num_rows"], message["num_new_blocks"]) == (1 << 40, 3, 5)
    assert message["temperature"] == 0.7 and message["last"] is True
    for name, sent in (("rows", rows), ("new_block_ids", blocks), ("logprobs", logprobs)):
        got = message[name]
        assert got.dtype == sent.dtype and np.array_equal(got, sent)
        assert not got.flags.owndata and not got.flags.writeable  # a view into the ring
        assert got.ctypes.data % 8 == 0
    copied = STEP.decode(record.payload, copy=True)
    assert copied["rows"].flags.owndata
    del message, got
    for _ in range(100):  # 100 KB through the 64 KiB ring: the record's bytes are overwritten
        writer.write(0, bytes(1000))
        reader.read(1.0)
    assert np.array_equal(copied["rows"], rows)  # the copy outlives the record
    writer.close()
    reader.close()


@pytest.mark.timeout(10)
def test_encode_matches_what_write_puts_on_the_ring_and_decodes_from_bytes(instance: str) -> None:
    writer, reader = pair(instance, "bytes")
    fields = {"step": 3, "temperature": 1.0, "last": False}
    arrays = {"rows": [1, 2], "new_block_ids": np.zeros(0, np.int32), "logprobs": [0.0, -1.0]}
    encoded = STEP.encode(fields, arrays)
    assert len(encoded) == STEP.nbytes(arrays) == 32 + 8 + 0 + 8
    STEP.write(writer, 1, fields, arrays)
    assert bytes(reader.read(1.0).payload) == encoded
    message = STEP.decode(encoded)
    assert message["new_block_ids"].shape == (0,) and message["logprobs"].tolist() == [0.0, -1.0]
    writer.close()
    reader.close()


@pytest.mark.timeout(10)
def test_bad_layouts_and_messages_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'x' has struct code 's'"):
        Layout("bad", header=[("x", "s")])
    with pytest.raises(ValueError, match="takes its length from 'size'"):
        Layout("bad", header=[("size", "d")], arrays=[("a", "int32", "size")])
    with pytest.raises(ValueError, match="duplicate field names \\['a'\\]"):
        Layout("bad", header=[("a", "i")], arrays=[("a", "int32", "a")])
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        Layout("bad", header=[("n", "i")], arrays=[("a", "complex64", "n")])
    fields = {"step": 1, "temperature": 0.0, "last": False}
    arrays = {"rows": [1], "new_block_ids": [], "logprobs": [0.5]}
    with pytest.raises(ValueError, match="missing header fields \\['step'\\]"):
        STEP.encode({"temperature": 0.0, "last": False}, arrays)
    with pytest.raises(ValueError, match="\\['num_rows'\\] are set from the array lengths"):
        STEP.encode({**fields, "num_rows": 1}, arrays)
    with pytest.raises(TypeError, match="'rows' must be int32, got int64"):
        STEP.encode(fields, {**arrays, "rows": np.array([1], np.int64)})
    with pytest.raises(ValueError, match="'rows' must be 1-D"):
        STEP.encode(fields, {**arrays, "rows": np.zeros((2, 2), np.int32)})
    encoded = STEP.encode(fields, arrays)
    with pytest.raises(ValueError, match="overruns"):
        STEP.decode(encoded[:-8])
    with pytest.raises(ValueError, match="shorter than"):
        STEP.decode(encoded[:8])
