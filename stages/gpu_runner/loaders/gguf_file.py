"""A GGUF file's header read fast: metadata as Python values, tensor infos, and each tensor's raw bytes (mmap).

The gguf package (llama.cpp's reader) builds an object per array element; on a 262,144-token
vocabulary that costs seconds at every load. This reader walks the same layout once with
`struct` and hands numeric arrays back as numpy arrays, and takes the quant types and block
sizes from the gguf package's constants.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type id -> (struct format, numpy dtype) of the scalar types
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A file that is not a readable GGUF file: the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (GGUF stores the dimensions innermost first)
    qtype: GGMLQuantizationType | int  # an int when the gguf package does not know the type
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """`metadata` (key -> value), `tensors` (name -> TensorInfo) and `raw(name)`: a tensor's bytes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise GGUFError(f"{self.path}: cannot be read: {exc}") from None
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._buf[:4]) != MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (it does not start with the bytes 'GGUF')")
        try:
            self._read_header()
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise GGUFError(f"{self.path}: truncated or corrupt GGUF header at byte {self._pos}: {exc}") from None

    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._buf, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        if self._pos + length > len(self._buf):
            raise struct.error(f"a string of {length} bytes runs past the end of the file")
        text = bytes(self._buf[self._pos:self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type][0])
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise struct.error(f"unknown value type {value_type}")
        item_type, count = self._unpack("<I"), self._unpack("<Q")
        if item_type in _SCALARS:
            dtype = np.dtype(_SCALARS[item_type][1])
            end = self._pos + count * dtype.itemsize
            if end > len(self._buf):
                raise struct.error(f"an array of {count} values runs past the end of the file")
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
            self._pos = end
            return values
        return [self._value(item_type) for _ in range(count)]

    def _read_header(self) -> None:
        self._pos = 4
        self.version = self._unpack("<I")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        num_tensors, num_values = self._unpack("<Q"), self._unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_values):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._unpack("<Q") for _ in range(self._unpack("<I"))]
            infos.append((name, tuple(reversed(dims)), self._unpack("<I"), self._unpack("<Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in infos:
            try:
                qtype: GGMLQuantizationType | int = GGMLQuantizationType(type_id)
                block, type_size = GGML_QUANT_SIZES[qtype]
                nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
            except (ValueError, KeyError):
                qtype, nbytes = type_id, 0  # refused by name when read
            info = TensorInfo(name, shape, qtype, data_start + offset, nbytes)
            if info.offset + nbytes > len(self._buf):
                raise GGUFError(f"{self.path}: truncated: tensor {name} ends at byte {info.offset + nbytes}, "
                                f"the file has {len(self._buf)}")
            self.tensors[name] = info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (uint8, not copied)."""
        info = self.tensors[name]
        return self._map[info.offset:info.offset + info.nbytes]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)
