"""Work the schedule must not do every step, and the fallbacks that keep it correct.

On CPU an all-gather copies this rank's chunk into the unsharded buffer and nothing else
(the peers' chunks are received in place); rebinding a parameter's data
(``torch.utils.swap_tensors``) must still be seen by the next all-gather, and optimizer
updates of the (packed) shards too.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.runtime._state import get_state
from tests._dist import environ, run_on_ranks
from tests._models import MLP


class _RecordCopies(TorchDispatchMode):
    """Records (op, bytes written) of every copy op."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "copy" in name:
            targets = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.copies.append((name, sum(t.numel() * t.element_size() for t in targets)))
        return func(*args, **(kwargs or {}))


def _copies_of_one_all_gather(param_dtype: torch.dtype | None) -> tuple[list[tuple[str, int]], int, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))  # big weights, small biases
    with environ(CPU_COLLECTIVES_ENV, "exchange"):  # with bf16 the group is under the 1 MiB of "auto"
        fsdp2.fully_shard(model, mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=param_dtype))
    with _RecordCopies() as mode:
        handle = model.unshard(async_op=True)
        handle.wait()
    full = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}  # unsharded, param dtype
    model.reshard()
    return mode.copies, sum(full.values()), full["0.bias"] + full["1.bias"]


def test_all_gather_copies_only_this_ranks_chunk():
    # On CPU the all-gather is an exchange: this rank's shards are copied (cast, with mixed
    # precision) into its own chunk of the unsharded buffer, the peers' chunks are received
    # in place. No copy-in buffer, no copy-out: 1/world of the bytes, plus the 16-byte header.
    # Chunks under 64 KiB (the biases here) travel packed in one message per peer: copied
    # into the packed buffer, and out of the one received.
    for param_dtype in (None, torch.bfloat16):
        copies, full_bytes, small_bytes = run_on_ranks(_copies_of_one_all_gather, 2, param_dtype)[0]
        own, small_own = full_bytes // 2, small_bytes // 2
        assert copies == [("_foreach_copy_", own), ("_foreach_copy_", small_own), ("copy_", 16),
                          ("_foreach_copy_", small_own)], (param_dtype, copies, full_bytes, small_bytes)
        assert small_own < own / 100


def _rebound_data_is_gathered() -> None:
    torch.manual_seed(0)
    model = MLP(8)
    fsdp2.fully_shard(model)
    weight = model.in_proj.weight
    new_full = torch.arange(weight.numel(), dtype=weight.dtype).view(weight.shape)
    # What load_state_dict / module conversions do under
    # torch.__future__.set_swap_module_params_on_conversion(True): the same Python
    # object afterwards holds other local data.
    replacement = nn.Parameter(distribute_tensor(new_full, weight.device_mesh, weight.placements))
    torch.utils.swap_tensors(weight, replacement)
    model.unshard()
    torch.testing.assert_close(model.in_proj.weight.detach(), new_full, rtol=0, atol=0)
    model.reshard()
    assert isinstance(model.in_proj.weight, torch.distributed.tensor.DTensor)
    torch.testing.assert_close(model.in_proj.weight.full_tensor(), new_full, rtol=0, atol=0)


def test_swapped_parameter_data_is_seen_by_the_next_all_gather():
    run_on_ranks(_rebound_data_is_gathered, 2)


def _optimizer_updates_reach_the_all_gather() -> None:
    torch.manual_seed(0)
    model = MLP(8)
    fsdp2.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    model(torch.ones(2, 8)).sum().backward()
    expected = {n: before[n] - 0.5 * p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()
    model.unshard()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n], rtol=0, atol=0)
    model.reshard()


def test_optimizer_updates_reach_the_all_gather():
    run_on_ranks(_optimizer_updates_reach_the_all_gather, 2)



def _sharded_with_reference() -> tuple[nn.Module, nn.Module]:
    """One flat group on 4 ranks whose tensors have 2 or 3 rows (rank 3 holds padding only), and
    the same model unsharded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 2), nn.Linear(2, 3))
    reference = nn.Sequential(nn.Linear(8, 2), nn.Linear(2, 3))
    reference.load_state_dict(model.state_dict())
    with environ(CPU_COLLECTIVES_ENV, "flat"):
        fsdp2.fully_shard(model)
    return model, reference


def _copy_out_of_padding_only_ranks() -> tuple[list[tuple[str, int]], list[float]]:
    model, reference = _sharded_with_reference()
    with _RecordCopies() as mode:
        model.unshard()
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)
    model.reshard()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    losses = []
    for step in range(3):  # the unsharded buffer's padding rows are never written: unread
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().sum()
        loss.backward()
        ref_loss = reference(x).square().sum()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss)
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        losses.append(loss.item())
    return [c for c in mode.copies if c[0] == "split_with_sizes_copy"], losses


def test_flat_copy_out_skips_the_ranks_holding_padding_only():
    # Each rank's slice after its 16-byte header: a (1, 8) fp32 chunk (32 bytes), then three
    # 1- or 2-element chunks padded to 16 bytes each: 80 bytes. Ranks 0-2 hold true rows,
    # rank 3 padding only: 3 x 80 bytes copied out, not 4 x 80.
    results = run_on_ranks(_copy_out_of_padding_only_ranks, 4)
    assert results[0][0] == [("split_with_sizes_copy", 3 * 80)], results[0][0]
    assert all(r[1] == results[0][1] for r in results)


def test_reduce_scatter_copy_in_fills_padding_only_ranks_with_zeros():
    # The rank-major copy-in of the ranks holding padding only is one fill of zeros: byte for
    # byte what chunking every gradient over all ranks gives, whatever the buffer held before
    # (a NaN sentinel), in the gradients' dtype or cast to the reduce dtype.
    from fsdp2._format import Chunking
    from fsdp2.comm._collectives import copy_rank_major

    cases = [
        (8, [(2, 4), (3,), (2,)]),  # ranks 3-7 padding only
        (4, [(3, 2), (3,)]),  # rank 3 padding only
        (4, [(8, 2), (1,)]),  # every rank holds rows of the first: no rank skipped
        (256, [(64, 64), (64,), (100,)]),  # the benchmark's shapes at world 256: ranks 100-255
    ]
    gen = torch.Generator().manual_seed(0)
    for world, shapes in cases:  # dim 0: one chunk_cat (and one fill)
        for dtype in (torch.float32, torch.bfloat16):
            grads = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
            layouts = [Chunking.even(g.shape, 0, world) for g in grads]
            total = sum(lay.local_numel for lay in layouts)
            expected = torch.empty(world, total)
            torch._chunk_cat(grads, dim=0, num_chunks=world, out=expected)
            got = torch.full((world, total), float("nan"))
            offsets = [sum(lay.local_numel for lay in layouts[:i]) for i in range(len(layouts))]
            copy_rank_major(got, layouts, grads, offsets)
            assert torch.equal(got, expected), (world, shapes, dtype)


def test_reduce_scatter_copy_in_of_uneven_shards_on_another_dim():
    # Shard(1) with fewer columns than a multiple of the world: each rank's chunk of columns,
    # zero past the gradient's end, in a few ops whatever the world (once one per rank),
    # byte for byte what cutting each rank's columns out one by one gives.
    from fsdp2._format import Chunking
    from fsdp2.comm._collectives import copy_rank_major

    gen = torch.Generator().manual_seed(0)
    for world, shapes in [(4, [(3, 10), (2, 7)]), (8, [(2, 3), (5, 16)]), (256, [(4, 100)]), (4, [(2, 8)])]:
        grads = [torch.randn(s, generator=gen) for s in shapes]
        layouts = [Chunking.even(g.shape, 1, world) for g in grads]
        total = sum(lay.local_numel for lay in layouts)
        expected = torch.zeros(world, total)
        off = 0
        for lay, g in zip(layouts, grads):
            for r in range(world):
                piece = torch.zeros(lay.local_shape)
                rows = lay.rows(r)
                piece[:, :rows] = g[:, r * lay.chunk:r * lay.chunk + rows]
                expected[r, off:off + lay.local_numel] = piece.flatten()
            off += lay.local_numel
        got = torch.full((world, total), float("nan"))
        offsets = [sum(lay.local_numel for lay in layouts[:i]) for i in range(len(layouts))]
        copy_rank_major(got, layouts, grads, offsets)
        assert torch.equal(got, expected), (world, shapes)


def _kept_all_gather_output() -> list[float]:
    # The flat all-gather's output on CPU is kept by the group's transport between all-gathers
    # (``KeptOutput``): allocated at issue, freed after the copy-out, viewed once; the copy-out
    # skips the entries' alignment padding. Four ranks, tensors of 2 or 3 rows (rank 3 holds
    # padding only) and 1-2 element chunks padded to 16 bytes: every path of the copy-out.
    model, reference = _sharded_with_reference()
    group = get_state(model).group
    model.unshard()
    (kept,) = group.gather_transport._kept.values()
    tensor, headers = kept.tensor, kept.headers
    assert tensor.untyped_storage().nbytes() == 0 and not kept.busy  # freed after the copy-out
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0)
    model.reshard()
    handle = model.unshard(async_op=True)
    assert kept.busy and tensor.untyped_storage().nbytes() == tensor.numel()  # in flight: allocated
    # Another all-gather of the same format through this transport meanwhile: one of its own.
    fmt = group._gather_format(group.world)
    other, other_kept = group.gather_transport._output(fmt, torch.device("cpu"))
    assert other_kept is None and other.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    handle.wait()
    model.reshard()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    losses = []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().sum()
        loss.backward()
        ref_loss = reference(x).square().sum()
        ref_loss.backward()
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        losses.append(loss.item())
    assert list(group.gather_transport._kept.values()) == [kept]
    assert kept.tensor is tensor and kept.headers is headers and tensor.untyped_storage().nbytes() == 0
    return losses


def test_flat_all_gather_output_is_kept_between_all_gathers_and_freed_after_each():
    results = run_on_ranks(_kept_all_gather_output, 4)
    assert all(r == results[0] for r in results)


def _dense_copy_out_matches_the_strided_one() -> bool:
    """The accelerators' dense copy-out (``comm/_flat.dense_copy_out``, whole slices, headers to
    a scratch) writes the unsharded buffer byte for byte as the CPU's strided one, here on CPU
    memory: entries with alignment padding, and a rank holding padding only."""
    from fsdp2.comm._flat import HEADER, dense_copy_out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 2), nn.Linear(2, 3), nn.LayerNorm(5))  # 2- or 3-row tensors
    with environ(CPU_COLLECTIVES_ENV, "flat"):
        fsdp2.fully_shard(model)
    group = model._fsdp_state().group
    fmt = group._gather_format(group.world)
    model.unshard()  # the unsharded buffer exists
    targets = group._targets(fmt)
    written = []
    for dense in (False, True):
        for chunk in targets.chunks:
            chunk.view(torch.uint8).fill_(0xAB)
        output = torch.randint(0, 256, (fmt.world * fmt.slice_bytes,), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(1))
        if dense:
            dense_copy_out(output, fmt.slice_bytes, targets.ranks, targets.split)
        else:
            rows = output.as_strided((targets.ranks, fmt.slice_bytes - HEADER), (fmt.slice_bytes, 1), HEADER)
            torch.split_with_sizes_copy(rows, targets.split[0], dim=1, out=targets.split[1])
        written.append([c.view(torch.uint8).clone() for c in targets.chunks])
    model.reshard()
    return targets.ranks < fmt.world and all(torch.equal(a, b) for a, b in zip(*written))


def test_dense_copy_out_writes_what_the_strided_one_does():
    assert run_on_ranks(_dense_copy_out_matches_the_strided_one, 4) == [True] * 4
