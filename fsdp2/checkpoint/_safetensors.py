"""A streaming safetensors writer, and the lazy import of the ``safetensors`` reader.

The format (https://huggingface.co/docs/safetensors): an 8-byte little-endian
header length, a JSON header mapping each name to its dtype, shape and
``[begin, end)`` byte offsets into the data section, then the tensors' raw
little-endian C-order bytes back to back, in offset order. Every offset is known
from shapes and dtypes alone, so the header is written first and each tensor's
bytes follow as soon as that one tensor exists: the writer never holds more
than one tensor. (``safetensors.torch.save_file`` needs the whole dict.)
"""

from __future__ import annotations

import json
import math
import struct
from types import ModuleType
from typing import BinaryIO

import torch

from .._wire import as_memoryview

__all__ = ["DTYPES", "StreamingWriter", "import_safetensors"]

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def import_safetensors() -> ModuleType:
    try:
        import safetensors
    except ImportError as e:
        raise ImportError(
            "fsdp2.checkpoint needs the 'safetensors' package to read safetensors files; "
            "install it with `pip install fsdp2[checkpoint]` (or `pip install safetensors`)"
        ) from e
    return safetensors


class StreamingWriter:
    """Write ``specs`` (name -> (shape, dtype)) to ``file``, then one tensor at a time, in order.

    Call :meth:`write` once per name, in the order of ``specs``; :meth:`close`
    checks that every tensor arrived.
    """

    def __init__(self, file: BinaryIO, specs: dict[str, tuple[torch.Size, torch.dtype]],
                 metadata: dict[str, str] | None = None) -> None:
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for name, (shape, dtype) in specs.items():
            if dtype not in DTYPES:
                raise TypeError(f"safetensors cannot store {name!r} of dtype {dtype}; "
                                f"supported: {', '.join(map(str, DTYPES))}")
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does
        file.write(struct.pack("<Q", len(raw)))
        file.write(raw)
        self._file = file
        self._pending = list(specs.items())
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._pending) or self._pending[self._next][0] != name:
            expected = self._pending[self._next][0] if self._next < len(self._pending) else "nothing"
            raise ValueError(f"safetensors writer: got {name!r}, expected {expected!r} next")
        shape, dtype = self._pending[self._next][1]
        if tensor.shape != shape or tensor.dtype != dtype:
            raise ValueError(f"safetensors writer: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                             f"the header says {tuple(shape)} {dtype}")
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(as_memoryview(data))  # a view: no second copy of the tensor
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._pending):
            missing = [name for name, _ in self._pending[self._next:]]
            raise RuntimeError(f"safetensors writer closed before writing {missing}")
