"""The two transports: point-to-point exchanges (CPU) and flat collectives (NCCL's path).

On CPU fsdp2 moves the parameters and gradients of groups of 1 MiB and more with
``isend``/``irecv`` straight into and out of the unsharded buffers (``fsdp2/_exchange.py``);
smaller CPU groups and GPUs use flat ``all_gather_into_tensor``/``reduce_scatter_tensor``
collectives. ``FSDP2_CPU_COLLECTIVES=exchange`` / ``flat`` puts every CPU group on one path,
so both are tested here whatever the model's size, the code NCCL runs included: the
layouts that exercise every branch of both (uneven and dim-1 shards, mixed dtypes, mixed
precision with a reduce-dtype cast, int ``reshard_after_forward``, HSDP, tensor parallelism)
must train to the unsharded reference either way.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp2
from fsdp2._collectives import CPU_COLLECTIVES_ENV, EXCHANGE_MIN_BYTES
from fsdp2._state import get_state
from tests import test_2d, test_mixed_precision, test_parity
from tests._dist import environ, run_on_ranks
from tests._models import MLP


def _under(transport: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` with CPU groups built on ``transport``."""
    with environ(CPU_COLLECTIVES_ENV, transport):
        return fn(*args)


def _transport_of_a_new_group(transport: str, dim: int) -> bool:
    model = MLP(dim)  # dim x 4 dim twice, fp32: 32 dim^2 bytes
    _under(transport, fsdp2.fully_shard, model)
    return get_state(model).group.exchange


def test_environment_variable_picks_the_cpu_transport():
    # auto (the default): exchanges from EXCHANGE_MIN_BYTES (1 MiB) of unsharded parameters.
    assert EXCHANGE_MIN_BYTES == 2**20
    assert run_on_ranks(_transport_of_a_new_group, 2, "auto", 8) == [False, False]  # 2 KiB
    assert run_on_ranks(_transport_of_a_new_group, 2, "auto", 256) == [True, True]  # 2 MiB
    assert run_on_ranks(_transport_of_a_new_group, 2, "exchange", 8) == [True, True]
    assert run_on_ranks(_transport_of_a_new_group, 2, "flat", 256) == [False, False]


def _bad_transport() -> str:
    with pytest.raises(ValueError, match=r"FSDP2_CPU_COLLECTIVES='nccl': use 'auto' \(the default\), "
                                         r"'exchange' or 'flat'"):
        _under("nccl", fsdp2.fully_shard, MLP(8))
    return "ok"


def test_unknown_transport_is_refused():
    assert run_on_ranks(_bad_transport, 2) == ["ok", "ok"]


LAYOUTS = {  # (rank function, world size, its arguments)
    "blocks_then_root": (test_parity._transformer_bottom_up, 2, ()),
    "uneven_dim0": (test_parity._uneven, 4, ()),
    "dim1_uneven": (test_parity._placement_uneven, 2, ()),
    "mixed_dtypes": (test_parity._mixed_dtypes, 2, ()),
    "int_reshard": (test_parity._reshard_after_forward, 4, (2, 1e-4)),
    "bf16_fp32_reduce": (test_mixed_precision._train_side_by_side,
                         2, ({"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},)),
    "hsdp": (test_2d._hsdp_parity, 4, (False,)),
    "tp": (test_2d._tp_parity, 4, ()),
}


@pytest.mark.parametrize("transport", ["exchange", "flat"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_both_transports_train_to_the_reference(layout, transport):
    fn, world, args = LAYOUTS[layout]
    results = run_on_ranks(_under, world, transport, fn, *args)
    if layout == "bf16_fp32_reduce":  # trained next to torch's fully_shard: the same numbers
        test_mixed_precision._check_matches_torch(results[0], torch.bfloat16)


def _user_traffic_beside_fsdp2() -> list[float]:
    """Point-to-point messages of the user's (tag 0) cross fsdp2's exchanges in flight."""
    return _under("exchange", _user_traffic)


def _user_traffic() -> list[float]:
    torch.manual_seed(0)
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    model = nn.Sequential(MLP(16), MLP(16))
    reference = [p.detach().clone() for p in model.parameters()]
    for block in model:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    handle = model[1].unshard(async_op=True)  # an all-gather in flight ...
    mine = torch.full((1000,), float(rank))
    theirs = torch.empty(1000)
    works = [dist.isend(mine, peer), dist.irecv(theirs, peer)]  # ... and the user's messages
    handle.wait()
    for w in works:
        w.wait()
    assert torch.equal(theirs, torch.full((1000,), float(peer)))
    for got, want in zip(model[1].parameters(), reference[len(reference) // 2:]):
        torch.testing.assert_close(got.detach(), want, rtol=0, atol=0)
    model[1].reshard()
    # A backward whose reduce-scatters are in flight while the user exchanges again.
    loss = model(torch.ones(4, 16) * (rank + 1)).sum()
    loss.backward()
    works = [dist.isend(mine + 1, peer), dist.irecv(theirs, peer)]
    for w in works:
        w.wait()
    assert torch.equal(theirs, torch.full((1000,), float(peer + 1)))
    return [p.grad.full_tensor().sum().item() for p in model.parameters()]


def test_user_point_to_point_messages_do_not_mix_with_fsdp2s():
    grads = run_on_ranks(_user_traffic_beside_fsdp2, 2)
    assert grads[0] == grads[1]  # averaged over both ranks: the same everywhere
