"""Communication setters: custom all-gather / reduce-scatter objects, their allocators, a separate
reduce-scatter process group, how many reduce-scatters stay in flight, and the torch names that
have nothing to do in fsdp2 (``share_comm_ctx``) or are not supported (symmetric memory)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as TorchAllGather
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as TorchReduceScatter

import fsdp2
from fsdp2.comm.cpu import _cma
from fsdp2.diagnostics import _trace
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.runtime._state import get_state
from tests._dist import environ, run_on_ranks
from tests._models import Transformer
from tests._parity import train_parity


class _CountingAllGather(TorchAllGather):
    """Written against torch's interface: fsdp2 must accept it unchanged."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, torch.dtype]] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append((output_tensor.numel() // input_tensor.numel(), output_tensor.dtype))
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _SummingReduceScatter(TorchReduceScatter):
    """Sums whatever op it is given and divides itself: the result must still be the average."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self.groups: list[dist.ProcessGroup] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.ops.append(str(op).rsplit(".", 1)[-1])
        self.groups.append(group)
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(dist.get_world_size(group))
        return None  # finished already: fsdp2 accepts a synchronous comm


def _custom_comms(transport: str) -> list[object]:
    gathers, scatters = [], []

    def shard(model: Transformer) -> None:
        with environ(CPU_COLLECTIVES_ENV, transport):
            for block in model.layers:
                fsdp2.fully_shard(block)
            fsdp2.fully_shard(model)
        for block in model.layers:
            gathers.append(_CountingAllGather())
            scatters.append(_SummingReduceScatter())
            block.set_custom_all_gather(gathers[-1])
            block.set_custom_reduce_scatter(scatters[-1])

    train_parity(Transformer, shard, steps=2)
    # Each block: gathered in forward and again in backward, reduced once, per step; the
    # root's own group keeps fsdp2's collectives (not recursive).
    assert [len(g.calls) for g in gathers] == [4, 4, 4]
    assert {c for g in gathers for c in g.calls} == {(2, torch.uint8)}  # bytes, from 2 ranks
    assert [s.ops for s in scatters] == [["AVG", "AVG"]] * 3
    return ["ok"]


@pytest.mark.parametrize("transport", ["flat", "read"])
def test_custom_comms_written_for_torch_run_every_collective_of_their_group(transport):
    # "read": the blocks would gather by reading each other's memory; a custom comm makes them flat.
    assert run_on_ranks(_custom_comms, 2, transport) == [["ok"], ["ok"]]


def _separate_reduce_scatter_group(transport: str) -> list[object]:
    seen = _SummingReduceScatter()

    def shard(model: Transformer) -> None:
        with environ(CPU_COLLECTIVES_ENV, transport):
            for block in model.layers:
                fsdp2.fully_shard(block)
            fsdp2.fully_shard(model)
        model.set_separate_reduce_scatter_group()
        if transport == "read":  # probed when made: its exchanges read too
            assert _cma.usable(get_state(model).group.policy.reduce_group)
        if transport == "flat":
            model.layers[0].set_custom_reduce_scatter(seen)

    train_parity(Transformer, shard, steps=2)
    return []


def _separate_group_is_one_new_group() -> list[object]:
    model = Transformer()
    for block in model.layers:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    model.set_separate_reduce_scatter_group()
    groups = [get_state(m).group for m in (*model.layers, model)]
    separate = {id(g.policy.reduce_group) for g in groups}
    assert len(separate) == 1 and groups[0].policy.reduce_group is not groups[0].process_group
    assert dist.get_process_group_ranks(groups[0].policy.reduce_group) == [0, 1]
    probe = _SummingReduceScatter()
    model.layers[1].set_custom_reduce_scatter(probe)
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    assert probe.groups == [groups[0].policy.reduce_group]  # the collective ran on the separate group
    model.set_separate_reduce_scatter_group(False)
    assert all(g.policy.reduce_group is None for g in groups)
    with pytest.raises(TypeError, match="enable must be a bool, got 'yes'"):
        model.set_separate_reduce_scatter_group("yes")
    return ["ok"]


@pytest.mark.parametrize("transport", ["flat", "read", "exchange"])
def test_separate_reduce_scatter_group_trains_the_same(transport):
    run_on_ranks(_separate_reduce_scatter_group, 2, transport)


def test_separate_reduce_scatter_group_is_one_group_used_by_the_reduce_scatters():
    assert run_on_ranks(_separate_group_is_one_new_group, 2) == [["ok"], ["ok"]]


def _reduce_waits(limit: int | None, transport: str = "auto") -> list[str]:
    """Issues and completions of the reduce-scatters in one backward, with ``limit`` in flight."""
    model = Transformer(n_layers=4)
    with environ(CPU_COLLECTIVES_ENV, transport):
        for block in model.layers:
            fsdp2.fully_shard(block)
        fsdp2.fully_shard(model)
    if limit is not None:
        model.set_reduce_scatter_max_input_buffers(limit)
    loss = model(torch.randint(0, 64, (2, 16))).sum()
    events: list[str] = []
    with _trace.on_event(lambda e: events.append(e) if e.startswith("reduce_scatter") else None):
        loss.backward()
    with pytest.raises(TypeError, match="max_input_buffers must be an int, got bool"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="max_input_buffers must be >= 1, got 0"):
        model.set_reduce_scatter_max_input_buffers(0)
    return [e.replace("reduce_scatter_done", "done").replace("reduce_scatter", "issue") for e in events]


def test_reduce_scatter_max_input_buffers_bounds_the_reduce_scatters_in_flight():
    # Default: one left in flight for the flat collectives (as torch), two for CPU exchanges.
    # The oldest are finished before a group issues its own, so no more are ever alive at once.
    one = run_on_ranks(_reduce_waits, 2, None)[0]
    assert one == ["issue layers.3", "done layers.3", "issue layers.2", "done layers.2", "issue layers.1",
                   "done layers.1", "issue layers.0", "done layers.0", "issue root", "done root"], one
    assert run_on_ranks(_reduce_waits, 2, 1, "read")[0] == one
    two = run_on_ranks(_reduce_waits, 2, None, "read")[0]
    assert two == ["issue layers.3", "issue layers.2", "done layers.3", "issue layers.1", "done layers.2",
                   "issue layers.0", "done layers.1", "issue root", "done layers.0", "done root"], two
    three = run_on_ranks(_reduce_waits, 2, 3)[0]
    assert three == ["issue layers.3", "issue layers.2", "issue layers.1", "done layers.3", "issue layers.0",
                     "done layers.2", "issue root", "done layers.1", "done layers.0", "done root"], three


def _allocators_and_compatibility() -> list[object]:
    def shard(model: Transformer) -> None:
        with environ(CPU_COLLECTIVES_ENV, "flat"):
            for block in model.layers:
                fsdp2.fully_shard(block)
            fsdp2.fully_shard(model)
        for module in (*model.layers, model):
            module.set_allocate_memory_from_process_group_for_comm(True)  # gloo has none: torch.empty
        model.set_separate_reduce_scatter_group()
        fsdp2.share_comm_ctx([model, *model.layers])  # one set of streams per device already

    train_parity(Transformer, shard, steps=2)
    model = fsdp2.fully_shard(torch.nn.Linear(4, 4))
    model.set_custom_all_gather(_CountingAllGather())
    # torch fails an assertion here: fsdp2's error is an AssertionError and a ValueError (_errors.py)
    with pytest.raises(AssertionError, match="has a custom comm \\(set_custom_all_gather\\)") as raised:
        model.set_allocate_memory_from_process_group_for_comm(True)
    assert isinstance(raised.value, ValueError)
    with pytest.raises(TypeError, match="set_custom_reduce_scatter: expected an object with allocate"):
        model.set_custom_reduce_scatter(lambda *args: None)
    with pytest.raises(ValueError, match="symmetric memory needs CUDA with NCCL; this module has cpu"):
        model.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match="share_comm_ctx: expected modules passed to fully_shard, got Linear"):
        fsdp2.share_comm_ctx([model, torch.nn.Linear(2, 2)])
    return ["ok"]


def test_process_group_allocator_share_comm_ctx_and_unsupported_symmetric_memory():
    assert run_on_ranks(_allocators_and_compatibility, 2) == [["ok"], ["ok"]]


def _custom_comms_on_4_ranks(layout: str) -> list[object]:
    from torch.distributed.device_mesh import init_device_mesh

    if layout == "hsdp":
        mesh, kwargs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("comm_rep", "comm_shard")), {}
    else:  # backward gathers within pairs of ranks: the custom all-gather runs on that subgroup too
        mesh, kwargs = init_device_mesh("cpu", (4,)), {"reshard_after_forward": 2}
    gathers, scatters = [], []

    def shard(model: Transformer) -> None:
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=mesh, **kwargs)
            gathers.append(_CountingAllGather())
            scatters.append(_SummingReduceScatter())
            block.set_custom_all_gather(gathers[-1])
            block.set_custom_reduce_scatter(scatters[-1])
        fsdp2.fully_shard(model, mesh=mesh)
        if layout == "hsdp":  # one new group per replica's shard ranks
            model.set_separate_reduce_scatter_group()

    train_parity(Transformer, shard, steps=2, atol=1e-4)
    world = 2 if layout == "hsdp" else 4
    if layout == "hsdp":
        used = {tuple(dist.get_process_group_ranks(g)) for s in scatters for g in s.groups}
        assert used == {tuple(mesh["comm_shard"].mesh.tolist())}
        assert all(g is not mesh["comm_shard"].get_group() for s in scatters for g in s.groups)
    # Forward over the shard axis; backward over it (HSDP) or over pairs (reshard to 2 ranks).
    assert {c for g in gathers for c in g.calls} == ({(2, torch.uint8)} if world == 2 else
                                                     {(4, torch.uint8), (2, torch.uint8)})
    assert [len(s.ops) for s in scatters] == [2, 2, 2]
    return ["ok"]


@pytest.mark.parametrize("layout", ["hsdp", "reshard_to_pairs"])
@pytest.mark.slow
def test_custom_comms_with_hsdp_and_int_reshard_after_forward(layout):
    assert run_on_ranks(_custom_comms_on_4_ranks, 4, layout) == [["ok"]] * 4


# ---- the division around a sum, and the process-group allocator ------------------------------------

@pytest.mark.parametrize("factor, pre, post", [
    (2, 2.0, 1.0), (3, 2.0, 1.5), (4, 2.0, 2.0), (6, 4.0, 1.5), (8, 4.0, 2.0), (12, 4.0, 3.0), (16, 4.0, 4.0),
    (32, 8.0, 4.0), (64, 8.0, 8.0), (128, 16.0, 8.0), (1000, 16.0, 62.5), (2.5, 1.0, 2.5),
])
def test_fp16_sums_divide_by_about_the_square_root_before_and_the_rest_after(factor, pre, post):
    from fsdp2.comm._collectives import reduce_op

    op, before, after = reduce_op(torch.float16, 2, factor)
    assert (op, before, after) == (dist.ReduceOp.SUM, pre, post)
    assert before * after == factor


def _process_group_buffers() -> list[object]:
    from fsdp2.comm._comm import process_group_comms

    gather, scatter = process_group_comms(dist.group.WORLD, dist.group.WORLD)
    made = [gather.allocate((3, 4), dtype=torch.float16, device=torch.device("cpu")),
            scatter.allocate([torch.tensor(5)], dtype=torch.float32, device="cpu")]
    return [[tuple(t.shape), str(t.dtype)] for t in made] + [list(gather._sources.values())]


def test_process_group_buffers_have_the_shape_asked_for():
    # gloo has no allocator of its own (asked once per device): torch.empty, shaped as asked.
    assert run_on_ranks(_process_group_buffers, 2) == [[[(3, 4), "torch.float16"], [(5,), "torch.float32"],
                                                        [None]]] * 2


# ---- the flat collectives' calls (fsdp2/_compat.py) ------------------------------------------
def _collective_calls(world: int, mode_active: bool) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """All-gather and reduce-scatter through fsdp2's entry points on a gloo group of ``world``
    ranks, optionally under a TorchFunctionMode that records what it sees."""
    from torch.overrides import TorchFunctionMode

    from fsdp2 import _compat

    seen: list[str] = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    rank = dist.get_rank()
    inp = torch.full((3,), float(rank + 1))
    gathered = torch.empty(world * 3)
    full = torch.arange(world * 2, dtype=torch.float32) * (rank + 1)
    reduced = torch.empty(2)
    with Recording() if mode_active else contextlib.nullcontext():
        work = _compat.all_gather_flat(gathered, inp, group=dist.group.WORLD, async_op=True)
        work.wait()
        assert _compat.reduce_scatter_flat(reduced, full, op=dist.ReduceOp.SUM, group=dist.group.WORLD) is None
    return seen, gathered, reduced


@pytest.mark.parametrize("mode_active", [False, True])
def test_flat_collectives_run_as_torchs_functions_do_and_a_function_mode_sees_them(mode_active):
    # Outside any mode fsdp2 calls the process group's own method (torch's function would do
    # nothing more); under a TorchFunctionMode it calls torch's function, which hands the call
    # to the mode, as it does for torch's FSDP2. The results are the same either way.
    results = run_on_ranks(_collective_calls, 2, 2, mode_active)
    names = {"all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"}
    for rank, (seen, gathered, reduced) in enumerate(results):
        assert torch.equal(gathered, torch.tensor([1.0] * 3 + [2.0] * 3))
        assert torch.equal(reduced, (torch.arange(4, dtype=torch.float32) * 3)[2 * rank:2 * rank + 2])
        collectives = [name for name in seen if name in names]
        assert len(collectives) == (2 if mode_active else 0), seen
