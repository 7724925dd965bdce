"""CRC-32 of every file a DCP save writes, taken from the bytes on their way to the file.

A checkpoint's completion marker records each file's CRC-32 next to its size, so damage that
keeps a file's size (a bad sector, a block overwritten by another job) is found before DCP
reads it, instead of surfacing as an unpickling error deep inside ``dcp.load``.

The sums are computed while the save writes: :class:`ChecksummingFileSystem` wraps the
backend a ``dcp.FileSystemWriter`` opens its files through, and each stream it hands out
folds every ``write`` into a running CRC. No file is read back. CRC-32 (zlib's, about
1.5 GiB/s on one core, and it releases the GIL) rather than a cryptographic hash: it
guards against accidents, not against someone forging a checkpoint.
"""

from __future__ import annotations

import os
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

__all__ = ["ChecksummingFileSystem", "crc32_of_file"]

_CHUNK = 8 * 2**20  # read size when a file is checked: large enough that a call costs nothing


class _HashingStream:
    """A writable stream that passes every write through and folds its bytes into ``crc``.

    DCP's writer calls ``write``, ``tell``, ``flush``, ``fileno`` (to fsync) and ``close``;
    everything else is the wrapped file's. A ``seek`` would make the running sum describe
    something other than the file, so it marks the sum unusable (the file is then summed by
    reading it back, see ``fsdp2.checkpoint.save``).
    """

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.crc = 0
        self.sequential = True

    def write(self, data: Any) -> int:
        written = self._raw.write(data)
        with memoryview(data) as view, view.cast("B") as flat:  # tensors' bytes come as typed views
            self.crc = zlib.crc32(flat[:written] if written is not None else flat, self.crc)
        return written

    def seek(self, *args: Any) -> int:
        self.sequential = False
        return self._raw.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


class ChecksummingFileSystem:
    """DCP's file-system backend, with the CRC-32 of every file written under ``root`` recorded.

    ``sums`` maps each file's path relative to ``root`` (POSIX) to its CRC-32, or to None when
    the stream was not written front to back. ``rename`` moves the entry with the file (DCP
    writes ``.metadata.tmp`` and renames it).
    """

    def __init__(self, inner: Any, root: str | os.PathLike) -> None:
        self._inner = inner
        self._root = Path(root)
        self.sums: dict[str, int | None] = {}

    def _name(self, path: str | os.PathLike) -> str:
        return Path(path).relative_to(self._root).as_posix()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as raw:
            if "w" not in mode:  # reading (DCP checks for an existing .metadata): nothing to sum
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
        # Only a stream closed without an exception gets a sum: a failed write fails the save.
        self.sums[self._name(path)] = stream.crc if stream.sequential else None

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self._inner.rename(path, new_path)
        if (old := self._name(path)) in self.sums:
            self.sums[self._name(new_path)] = self.sums.pop(old)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def crc32_of_file(path: str | os.PathLike) -> int:
    """The CRC-32 of a file's bytes, read in large chunks into one reused buffer."""
    crc = 0
    buffer = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as f, memoryview(buffer) as view:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return crc
