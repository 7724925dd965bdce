"""Small values between ranks without numpy (``fsdp2/_wire.py``).

torch's object collectives need numpy, which torch does not depend on; fsdp2 sends its
few small values (rank-agreement text, pipe directories, checkpoint paths) as byte
tensors instead. These tests run the exchanges with numpy made unimportable.
"""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed as dist

from fsdp2 import _wire
from tests._dist import run_on_ranks


def _exchange_values() -> tuple[list, object, bytes]:
    rank = dist.get_rank()
    mine = {"rank": rank, "text": "é" * (3 * rank)} if rank != 1 else None  # lengths differ, one is null
    gathered = _wire.all_gather_json(mine)
    sent = _wire.broadcast_json(["from", rank, "ü"] if rank == 1 else None, src=1)
    empty = _wire.all_gather_bytes(b"" if rank == 0 else b"\x00\xff")
    return gathered, sent, empty


def test_values_of_any_length_reach_every_rank():
    # 4 ranks: the test world's pool of 4 is running anyway (a pool of 3 would start for this test alone).
    for got in run_on_ranks(_exchange_values, 4):
        gathered, sent, empty = got
        assert gathered == [{"rank": 0, "text": ""}, None, {"rank": 2, "text": "éééééé"},
                            {"rank": 3, "text": "ééééééééé"}]
        assert sent == ["from", 1, "ü"]
        assert empty == [b"", b"\x00\xff", b"\x00\xff", b"\x00\xff"]


def test_memoryview_is_the_tensors_bytes_without_a_copy():
    t = torch.arange(6, dtype=torch.int16)
    view = _wire.as_memoryview(t)
    assert bytes(view) == t.numpy().tobytes()
    t[0] = 7  # a view, not a copy
    assert bytes(view)[:2] == (7).to_bytes(2, sys.byteorder)
    assert bytes(_wire.as_memoryview(torch.empty(0))) == b""


_NO_NUMPY = r"""
import sys
sys.modules["numpy"] = None  # any `import numpy` now raises ImportError
import os, torch, torch.distributed as dist, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
import fsdp2
from fsdp2 import _wire
rank = int(sys.argv[2])
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=rank, world_size=2)
try:
    dist.all_gather_object([None, None], 1)
except Exception as e:
    assert "umpy" in str(e), e  # torch's own object collective does need numpy
else:
    raise AssertionError("numpy was importable")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
mesh = init_device_mesh("cpu", (2,))
fsdp2.fully_shard(model[0], mesh=mesh)
fsdp2.fully_shard(model, mesh=mesh)
model(torch.ones(2, 4)).sum().backward()  # lazy init runs the rank-agreement check
assert _wire.all_gather_json(rank) == [0, 1]
print("trained without numpy", flush=True)
os._exit(0)  # gloo over a FileStore sometimes aborts in its own teardown at exit (also without fsdp2)
"""


def test_lazy_init_and_a_step_need_no_numpy(tmp_path):
    store = str(tmp_path / "store")
    ranks = [subprocess.Popen([sys.executable, "-c", _NO_NUMPY, store, str(r)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for proc in ranks:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        assert "trained without numpy" in out
