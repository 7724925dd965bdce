"""The multi-process harness itself: results, failures, hangs, and torch's FSDP2 on gloo."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_on_ranks
from tests._models import Transformer, lm_loss, make_batch


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sums_ranks(world_size):
    expected = float(sum(range(world_size)))
    assert run_on_ranks(_sum_of_ranks, world_size) == [expected] * world_size


def _identity(x, *, scale):
    return {"rank": dist.get_rank(), "value": x * scale, "worker": os.environ["FSDP2_TEST_WORKER"],
            "rand": torch.rand(2), "pid": os.getpid()}


def test_returns_values_by_rank_with_args_and_seed():
    out = run_on_ranks(_identity, 2, 3, scale=2)
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["value"] == 6 and o["worker"] == "1" for o in out)
    # Every task starts from torch.manual_seed(0), on every rank and every call.
    again = run_on_ranks(_identity, 2, 3, scale=2)
    torch.testing.assert_close(out[0]["rand"], out[1]["rand"])
    torch.testing.assert_close(out[0]["rand"], again[0]["rand"])
    assert [o["pid"] for o in out] == [o["pid"] for o in again], "pool should be reused"


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom from the second rank")
    return os.getpid()


def test_failure_on_one_rank_reports_rank_and_traceback():
    pids = [o["pid"] for o in run_on_ranks(_identity, 2, 0, scale=0)]
    with pytest.raises(AssertionError, match=r"(?s)rank\(s\) \[1\].*===== rank 1 =====.*"
                                             r"ValueError: boom from the second rank"):
        run_on_ranks(_fail_on_rank_one, 2)
    # Both ranks answered and the world still reduces correctly, so the pool is kept.
    assert [o["pid"] for o in run_on_ranks(_identity, 2, 0, scale=0)] == pids


def _hang_after_peer_fails():
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gives up")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: rank 0 blocks here


@pytest.mark.slow  # among the quick suite's longest (CI runs it on torch 2.13)
def test_rank_stuck_in_collective_is_killed_and_pool_recovers():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 0 did not finish within 1.0 s after "
                                             r"rank 1 failed.*RuntimeError: rank 1 gives up"):
        run_on_ranks(_hang_after_peer_fails, 2, grace=1.0)
    assert time.monotonic() - start < 10
    assert run_on_ranks(_sum_of_ranks, 2) == [1.0, 1.0]


def _sleep(seconds):
    time.sleep(seconds)


@pytest.mark.slow  # among the quick suite's longest (CI runs it on torch 2.13)
def test_timeout_kills_pool_and_pool_recovers():
    with pytest.raises(AssertionError, match=r"rank 0 did not finish within 0.5 s"):
        run_on_ranks(_sleep, 2, 60, timeout=0.5)
    assert run_on_ranks(_sum_of_ranks, 2) == [1.0, 1.0]


def _print_something():
    print(f"hello from rank {dist.get_rank()}", flush=True)
    os.write(2, b"raw fd write\n")


def test_worker_output_is_replayed_with_rank_labels(capsys):
    run_on_ranks(_print_something, 2)
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0" in out and "[rank 1] hello from rank 1" in out
    assert "[rank 1] raw fd write" in out


def test_rejects_local_functions():
    def local():
        pass

    with pytest.raises(TypeError, match="module-level function"):
        run_on_ranks(local, 2)


def _torch_fully_shard_two_steps():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ref = Transformer()
    model = Transformer()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        x, y = make_batch(rank, step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        # Reference: the same global batch, gradients averaged over ranks like FSDP does.
        ref_loss = sum(lm_loss(ref(xr), yr) for xr, yr in
                       (make_batch(r, step) for r in range(world))) / world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), p_ref, msg=lambda m: f"{name}: {m}")
    return losses


@pytest.mark.slow  # among the quick suite's longest (CI runs it on torch 2.13)
def test_torch_fully_shard_matches_reference_on_gloo():
    losses = run_on_ranks(_torch_fully_shard_two_steps, 2)
    assert len(losses) == 2 and all(len(per_rank) == 2 for per_rank in losses)
    assert losses[0] != losses[1]  # each rank saw its own data
