"""Two ranks of a read all-gather where one process leaves early (run by test_safe_reads.py).

Each rank is a process of its own, started the way torchrun starts ranks (a fresh
interpreter: ``python -m tests.comm._exit_scenarios ...``) or the way ``mp.spawn`` does (a
multiprocessing child, which leaves by ``os._exit`` after multiprocessing's exit hook), so
that interpreter exit really happens. Scenarios:

* ``exit``: rank 0 reads rank 1's chunk, destroys its process group and ends its process
  while rank 1 has not read rank 0's chunk yet; rank 1 reads it once rank 0 is gone (or 5 s
  later). Rank 1 must get the right values (rank 0's exit waits for its acknowledgement).
* ``peer_dies``: rank 1 is killed before it reads rank 0's chunk; rank 0 then exits and
  must neither hang nor wait out the full bound, and must say that the peer is gone.

Each rank writes a JSON result to ``<out>.rank<r>.json``; the flag file ``<out>.left``
says that rank 0 has returned from its main function.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _wait_for(path: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def _write_json(path: str, value: object) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)  # whole or absent: the other rank polls for it


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def main(rank: int, scenario: str, init_file: str, out: str) -> None:
    os.environ["FSDP2_CPU_COLLECTIVES"] = "read"
    import torch
    import torch.distributed as dist

    import fsdp2
    from tests._models import MLP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = MLP(256)
    full = [p.detach().clone() for p in model.parameters()]
    fsdp2.fully_shard(model)
    model.unshard(async_op=True)  # probes, then offers this rank's chunk to the peer
    result: dict[str, object] = {"pid": os.getpid()}
    if rank == 0:
        model.unshard()  # reads rank 1's chunk; rank 1 has not read rank 0's
        result["right"] = all(torch.equal(p.detach(), f) for p, f in zip(model.parameters(), full))
        _write_json(f"{out}.rank0.json", result)
        if scenario == "peer_dies":
            _wait_for(f"{out}.rank1.json")  # rank 1 is about to be killed, unread
            with open(f"{out}.rank1.json") as f:
                peer = json.load(f)["pid"]
            while not _gone(peer):
                time.sleep(0.01)
        else:  # as a script ends (gloo's teardown would otherwise wait for the peer to leave too)
            dist.destroy_process_group()
        open(f"{out}.left", "w").close()
        return  # the process ends here, the model still unsharded (nothing waited for the peer's read)
    if scenario == "peer_dies":
        _wait_for(f"{out}.rank0.json")  # rank 0 has read this rank's chunk
        _write_json(f"{out}.rank1.json", result)
        os.kill(os.getpid(), signal.SIGKILL)  # gone without reading rank 0's chunk
    _wait_for(f"{out}.left")
    with open(f"{out}.rank0.json") as f:
        peer = json.load(f)["pid"]
    deadline = time.monotonic() + 5.0
    while not _gone(peer) and time.monotonic() < deadline:  # without a guard rank 0 is gone at once
        time.sleep(0.01)
    try:
        model.unshard()  # reads rank 0's chunk
        result["right"] = all(torch.equal(p.detach(), f) for p, f in zip(model.parameters(), full))
        model.reshard()  # rank 0 acknowledged reading rank 1's chunk before it left
    except RuntimeError as e:
        result["error"] = str(e)
    _write_json(f"{out}.rank1.json", result)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
