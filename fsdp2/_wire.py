"""Small values between ranks as byte tensors: what torch's object collectives do, without numpy.

``dist.all_gather_object`` and ``dist.broadcast_object_list`` turn tensors back into
bytes with ``Tensor.numpy()``, and torch does not depend on numpy: on a machine without
it they raise ``RuntimeError: Numpy is not available``. fsdp2 only ever exchanges text
(digests, descriptions, paths) and small JSON values, so it sends them as ``uint8``
tensors and reads them back through the buffer protocol of a ``ctypes`` array.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["as_memoryview", "all_gather_bytes", "all_gather_json", "broadcast_json"]


def as_memoryview(data: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy; valid while ``data`` lives."""
    if data.device.type != "cpu" or not data.is_contiguous():
        raise ValueError("as_memoryview needs a contiguous CPU tensor")
    nbytes = data.numel() * data.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")


def _device(pg: dist.ProcessGroup | None) -> torch.device:
    """Where a collective on ``pg`` takes its tensors: CPU if the group has gloo, else the GPU."""
    backend = str(dist.get_backend(pg)).lower()
    if "gloo" in backend or "fake" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _to_bytes(data: torch.Tensor) -> bytes:
    return bytes(as_memoryview(data.cpu().contiguous()))


def all_gather_bytes(data: bytes, pg: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's ``data`` (of any length), in group rank order."""
    device = _device(pg)
    world = dist.get_world_size(pg)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=pg)
    lengths = [int(s.item()) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    mine = mine.to(device)
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine, group=pg)
    return [_to_bytes(t[:n]) for t, n in zip(out, lengths)]


def all_gather_json(value: Any, pg: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON-serialisable ``value``, in group rank order."""
    raw = all_gather_bytes(json.dumps(value).encode(), pg)
    return [json.loads(r.decode()) for r in raw]


def broadcast_json(value: Any, src: int = 0, pg: dist.ProcessGroup | None = None) -> Any:
    """``value`` as global rank ``src`` has it, on every rank of ``pg`` (JSON-serialisable)."""
    device = _device(pg)
    raw = json.dumps(value).encode() if dist.get_rank() == src else b""
    size = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=pg)
    data = torch.zeros(int(size.item()), dtype=torch.uint8)
    if raw:
        data.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    data = data.to(device)
    dist.broadcast(data, src=src, group=pg)
    return json.loads(_to_bytes(data).decode())
