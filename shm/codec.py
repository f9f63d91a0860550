"""Fixed binary message layouts: a struct header of numbers, then raw 1-D arrays.

A Layout names its header fields (struct codes) and its arrays (numpy dtypes, each with the
header field that holds its length). Encoding copies each array's bytes once, straight into a
ring record when used with `write`; decoding reads the header with one struct call and gives
each array as a numpy view into the payload: no copy, no per-element work, no pickle. Views are
valid as long as the payload is (for a ring record: until the reader's next read or release),
unless decode is asked to copy.

Every part starts on an 8-byte boundary, so views are aligned; all values are little-endian.
"""
from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import numpy as np

from shm.ring import RingWriter

HEADER_CODES = frozenset("bBhHiIqQfd?")  # struct codes: ints, floats, bool
_INT_CODES = frozenset("bBhHiIqQ")
ARRAY_DTYPES = frozenset(np.dtype(name) for name in
                         ("int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64", "bool"))
FieldValue = int | float | bool | np.ndarray


def _pad8(num_bytes: int) -> int:
    return (num_bytes + 7) & -8


class Layout:
    """One message type: `header` is [(field, struct code)], `arrays` is [(name, dtype, length field)].

    Length fields are filled in from the arrays when encoding; do not pass them.
    """

    __slots__ = ("name", "_struct", "_header_names", "_header_bytes", "_arrays", "_length_index", "_set_by_arrays")

    def __init__(self, name: str, header: Sequence[tuple[str, str]],
                 arrays: Sequence[tuple[str, str, str]] = ()) -> None:
        self.name = name
        names = [field for field, _ in header] + [array for array, _, _ in arrays]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"layout {name!r}: duplicate field names {duplicates}")
        codes = {}
        for field, code in header:
            if code not in HEADER_CODES:
                raise ValueError(f"layout {name!r}: field {field!r} has struct code {code!r}, "
                                 f"expected one of {''.join(sorted(HEADER_CODES))}")
            codes[field] = code
        self._struct = struct.Struct("<" + "".join(code for _, code in header))
        self._header_names = tuple(field for field, _ in header)
        self._header_bytes = _pad8(self._struct.size)
        parsed = []
        for array, dtype_name, length_field in arrays:
            dtype = np.dtype(dtype_name)
            if dtype not in ARRAY_DTYPES:
                raise ValueError(f"layout {name!r}: array {array!r} has dtype {dtype_name!r}, "
                                 f"expected one of {sorted(str(d) for d in ARRAY_DTYPES)}")
            if codes.get(length_field) not in _INT_CODES:
                raise ValueError(f"layout {name!r}: array {array!r} takes its length from {length_field!r}, "
                                 "which is not an integer header field")
            parsed.append((array, dtype.newbyteorder("<"), length_field))
        self._arrays = tuple(parsed)
        self._length_index = tuple(self._header_names.index(length) for _, _, length in parsed)
        self._set_by_arrays = frozenset(length for _, _, length in parsed)

    def _prepare(self, fields: Mapping[str, int | float | bool],
                 arrays: Mapping[str, object]) -> tuple[list[int | float | bool], list[np.ndarray]]:
        given = set(fields)
        unknown = given - set(self._header_names)
        if unknown:
            raise ValueError(f"layout {self.name!r}: unknown header fields {sorted(unknown)}")
        if given & self._set_by_arrays:
            raise ValueError(f"layout {self.name!r}: {sorted(given & self._set_by_arrays)} are set from the "
                             "array lengths; do not pass them")
        missing = set(self._header_names) - given - self._set_by_arrays
        if missing:
            raise ValueError(f"layout {self.name!r}: missing header fields {sorted(missing)}")
        if set(arrays) != {array for array, _, _ in self._arrays}:
            raise ValueError(f"layout {self.name!r}: arrays must be exactly "
                             f"{[array for array, _, _ in self._arrays]}, got {sorted(arrays)}")
        values: list[int | float | bool] = [fields.get(field, 0) for field in self._header_names]
        prepared = []
        for (array, dtype, _), index in zip(self._arrays, self._length_index):
            value = arrays[array]
            if isinstance(value, np.ndarray):
                if value.dtype != dtype:
                    raise TypeError(f"layout {self.name!r}: array {array!r} must be {dtype}, got {value.dtype}")
                value = np.ascontiguousarray(value)
            else:
                value = np.asarray(value, dtype=dtype)
            if value.ndim != 1:
                raise ValueError(f"layout {self.name!r}: array {array!r} must be 1-D, got shape {value.shape}")
            values[index] = value.shape[0]
            prepared.append(value)
        return values, prepared

    def nbytes(self, arrays: Mapping[str, object]) -> int:
        """Encoded size of a message holding `arrays`."""
        return self._header_bytes + sum(_pad8(len(arrays[a]) * dtype.itemsize) for a, dtype, _ in self._arrays)

    def _encode_into(self, buf: memoryview, values: list[int | float | bool], prepared: list[np.ndarray]) -> None:
        self._struct.pack_into(buf, 0, *values)
        offset = self._header_bytes
        for value in prepared:
            buf[offset:offset + value.nbytes] = value.view(np.uint8)
            offset += _pad8(value.nbytes)

    def encode(self, fields: Mapping[str, int | float | bool], arrays: Mapping[str, object] = {}) -> bytes:
        """The message as bytes (for anything that is not a ring)."""
        values, prepared = self._prepare(fields, arrays)
        buf = bytearray(self._header_bytes + sum(_pad8(v.nbytes) for v in prepared))
        self._encode_into(memoryview(buf), values, prepared)
        return bytes(buf)

    def write(self, writer: RingWriter, kind: int, fields: Mapping[str, int | float | bool],
              arrays: Mapping[str, object] = {}, timeout: float | None = None) -> None:
        """Encode straight into one record of `writer`'s ring (blocks and raises like write())."""
        values, prepared = self._prepare(fields, arrays)
        view = writer.reserve(kind, self._header_bytes + sum(_pad8(v.nbytes) for v in prepared), timeout)
        try:
            self._encode_into(view, values, prepared)
        except BaseException:
            writer.abort()
            raise
        finally:
            view.release()
        writer.commit()

    def decode(self, payload: object, *, copy: bool = False) -> dict[str, FieldValue]:
        """Header fields and arrays of one message. Arrays are read-only views of `payload`
        unless `copy`."""
        buf = memoryview(payload).toreadonly()
        if buf.nbytes < self._header_bytes:
            raise ValueError(f"layout {self.name!r}: {buf.nbytes}-byte payload is shorter than the "
                             f"{self._header_bytes}-byte header")
        values = self._struct.unpack_from(buf, 0)
        message: dict[str, FieldValue] = dict(zip(self._header_names, values))
        offset = self._header_bytes
        for (array, dtype, _), index in zip(self._arrays, self._length_index):
            count = values[index]
            end = offset + count * dtype.itemsize
            if count < 0 or end > buf.nbytes:
                raise ValueError(f"layout {self.name!r}: array {array!r} of {count} elements overruns the "
                                 f"{buf.nbytes}-byte payload")
            view = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
            message[array] = view.copy() if copy else view
            offset = _pad8(end)
        return message
