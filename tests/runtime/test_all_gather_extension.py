"""The all-gather extension: parameters whose local tensor subclass gathers compact data.

The subclass is ``tests/_int8.py``'s ``Int8Rows`` (int8 rows and a per-row fp32 scale; its
``fsdp_pre_all_gather`` returns ``(qdata, scale)``, its ``fsdp_post_all_gather`` rebuilds the
subclass). Models holding such weights (trainable, and frozen under a LoRA adapter) train with
fsdp2, torch's ``fully_shard`` and an unsharded reference side by side on every transport, 1-D
and HSDP; the tests check that the hooks ran, that the all-gather carried the compact bytes,
and that bad hooks get clear errors.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2._format import HEADER
from tests._dist import environ, run_on_ranks
from tests._int8 import Int8Rows, Int8RowsV1
from tests._parity import average_grads, full

DIM = 32
TRANSPORTS = ["flat", "exchange", "read"]


class QuantLinear(nn.Module):
    """A linear layer whose weight is an ``Int8Rows`` (trainable, or frozen with a LoRA adapter)."""

    def __init__(self, dim_in: int, dim_out: int, frozen: bool, cls: type = Int8Rows) -> None:
        super().__init__()
        w = torch.randn(dim_out, dim_in) / math.sqrt(dim_in)
        self.weight = nn.Parameter(cls.from_float(w), requires_grad=not frozen)
        self.bias = nn.Parameter(torch.randn(dim_out) * 0.1)
        self.lora = None
        if frozen:  # QLoRA: a trainable low-rank update beside the frozen quantized base
            self.lora = nn.Sequential(nn.Linear(dim_in, 4, bias=False), nn.Linear(4, dim_out, bias=False))
            nn.init.normal_(self.lora[1].weight, std=0.05)
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        return out if self.lora is None else out + self.lora(x)


class Net(nn.Module):
    def __init__(self, frozen: bool, rows: int = DIM, cls: type = Int8Rows) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([QuantLinear(DIM, rows, frozen, cls), QuantLinear(rows, DIM, frozen, cls)])
        self.head = nn.Linear(DIM, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _build(frozen: bool, rows: int = DIM, cls: type = Int8Rows) -> nn.Module:
    torch.manual_seed(0)
    return Net(frozen, rows, cls)


def _shard(model: nn.Module, fully_shard, mesh, **kwargs) -> nn.Module:
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _dense(t: torch.Tensor) -> torch.Tensor:
    """The logical values of a (possibly sharded, possibly Int8Rows) tensor, as a plain tensor."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.dequantize() if isinstance(t, Int8Rows) else t


class _CountingAllGather:
    """A custom all-gather (flat) that records the bytes each rank sends."""

    def __init__(self) -> None:
        self.sent: list[int] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.sent.append(input_tensor.numel() * input_tensor.element_size())
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def _train(frozen: bool, transport: str, hsdp: bool = False, rows: int = DIM, cls: type = Int8Rows,
           steps: int = 3, torch_too: bool = True, mp: bool = False, count: bool = False,
           offload: bool = False) -> dict:
    """Train fsdp2, torch's fully_shard (when ``torch_too``) and the unsharded reference; compare every step."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")) if hsdp \
        else init_device_mesh("cpu", (world,))
    policy = dict(mp_policy=fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)) if mp else {}
    torch_policy = dict(mp_policy=TorchMP(param_dtype=torch.bfloat16)) if mp else {}
    if offload:  # on CPU the moves are no-ops: this pins that the hooks see the shard where it lives
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload

        policy["offload_policy"] = fsdp2.CPUOffloadPolicy()
        torch_policy["offload_policy"] = TorchOffload(pin_memory=False)
    with environ(CPU_COLLECTIVES_ENV, transport):
        models = {"ref": _build(frozen, rows, cls),
                  "fsdp2": _shard(_build(frozen, rows, cls), fsdp2.fully_shard, mesh, **policy)}
    counter = _CountingAllGather()
    if count:
        models["fsdp2"].blocks[0].set_custom_all_gather(counter)
    if torch_too:
        models["torch"] = _shard(_build(frozen, rows, cls), torch_fully_shard, mesh, **torch_policy)
    opts = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, foreach=False)
            for name, m in models.items()}
    Int8Rows.pre_calls = 0
    seen = []  # the weight the fsdp2 block computes with: the rebuilt subclass, in param_dtype
    models["fsdp2"].blocks[0].register_forward_pre_hook(
        lambda m, _args: seen.append((type(m.weight).__name__, str(m.weight.dtype))))
    tol = dict(atol=2e-2, rtol=2e-2) if mp else dict(atol=1e-5, rtol=1e-5)
    # In the same order on every rank (full_tensor is a collective): a list, not a set.
    others = [name for name in models if name != "ref"]
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x = torch.randn(4, DIM, generator=g)
        losses = {}
        for name, model in models.items():
            losses[name] = model(x).square().mean()
            losses[name].backward()
        average_grads(models["ref"])
        named = {name: dict(m.named_parameters()) for name, m in models.items()}
        for pname, ref in named["ref"].items():
            for other in others:
                p = named[other][pname]
                assert (p.grad is None) == (ref.grad is None), (step, other, pname)
                if ref.grad is not None:
                    torch.testing.assert_close(full(p.grad), ref.grad, **tol,
                                               msg=lambda m: f"step {step} {other} {pname} grad: {m}")
                    if other == "fsdp2" and "torch" in named:  # same collectives: the same bits
                        torch.testing.assert_close(full(p.grad), full(named["torch"][pname].grad), atol=0, rtol=0)
        for opt in opts.values():
            opt.step()
            opt.zero_grad(set_to_none=True)
        for pname, ref in named["ref"].items():
            for other in others:
                if mp and "torch" in named:  # bf16 compute drifts from the fp32 reference: torch's bits instead
                    torch.testing.assert_close(_dense(named[other][pname].detach()),
                                               _dense(named["torch"][pname].detach()), atol=0, rtol=0)
                    continue
                # Requantizing after the step may round an element one step apart: one quantum of slack.
                torch.testing.assert_close(_dense(named[other][pname].detach()), _dense(ref.detach()),
                                           atol=2e-2, rtol=0, msg=lambda m: f"step {step} {other} {pname}: {m}")
        for other in others:
            torch.testing.assert_close(losses[other].float(), losses["ref"], **tol)
    group = models["fsdp2"].blocks[0]._fsdp2_state.group
    return {"pre_calls": Int8Rows.pre_calls, "slice_bytes": group._formats[group.world].slice_bytes,
            "exchange": group.transport.gathers_in_place, "seen": seen[-1],
            "sent": counter.sent}


def _slice_bytes(rows: int, cols: int, world: int) -> int:
    """The compact all-gather slice of one ``QuantLinear`` (rows x cols weight, bias) per rank."""
    chunk = math.ceil(rows / world)
    aligned = [(n + 15) // 16 * 16 for n in (chunk * cols, chunk * 4, chunk * 4)]  # int8, scale, fp32 bias
    return HEADER + sum(aligned)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_trainable_int8_weights_match_torch_and_the_reference(transport):
    results = run_on_ranks(_train, 2, False, transport)
    for r in results:
        # Two groups with one Int8Rows each, 3 steps; torch's fully_shard calls the hook as often.
        assert r["pre_calls"] >= 2 * 2 * 3, r
        assert r["slice_bytes"] == _slice_bytes(DIM, DIM, 2), r  # int8 data and scales, not fp32
        assert r["exchange"] == (transport != "flat")
        assert r["seen"] == ("Int8Rows", "torch.float32")


def test_a_custom_all_gather_sends_the_compact_bytes():
    for r in run_on_ranks(_train, 2, False, "exchange", count=True, steps=2):
        # Forward and backward each step; the custom collective makes that group's all-gather flat.
        assert r["sent"] == [_slice_bytes(DIM, DIM, 2)] * 4, r["sent"]


def test_one_rank_still_runs_the_hooks():
    # torch 2.13's fully_shard hands the rebuild one output for two inputs on one rank: the reference only.
    results = run_on_ranks(_train, 1, False, "flat", steps=2, torch_too=False)
    assert results[0]["pre_calls"] >= 2 * 2 * 2 and results[0]["seen"] == ("Int8Rows", "torch.float32")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_frozen_int8_base_with_lora_matches_torch_and_the_reference(transport):
    run_on_ranks(_train, 2, True, transport)


@pytest.mark.parametrize("transport", ["flat", "read"])
def test_hsdp(transport):
    run_on_ranks(_train, 4, False, transport, hsdp=True)


def test_old_one_argument_pre_all_gather():
    results = run_on_ranks(_train, 2, False, "exchange", cls=Int8RowsV1)
    assert all(r["pre_calls"] > 0 for r in results)


def test_cpu_offload():
    results = run_on_ranks(_train, 2, True, "exchange", offload=True, steps=2)
    assert all(r["pre_calls"] > 0 for r in results)


def test_mixed_precision_passes_param_dtype_to_the_rebuild():
    results = run_on_ranks(_train, 2, True, "flat", mp=True)
    assert all(r["seen"] == ("Int8Rows", "torch.bfloat16") for r in results), results


@pytest.mark.parametrize("transport", ["flat", "exchange"])
def test_uneven_rows_padded_by_the_hook(transport):
    # 9 rows over 2 ranks: rank 1 holds 4 rows and pads its inputs to 5. torch's fully_shard
    # refuses inputs of another shape than the padded shard (the scales), so: the reference only.
    results = run_on_ranks(_train, 2, False, transport, rows=9, torch_too=False)
    assert all(r["pre_calls"] > 0 for r in results)


# ---- hooks attached after fully_shard ----------------------------------------------------------
class RoundedLinear(nn.Linear):
    """Computes with its weight rounded to bf16, the gradient straight through: what a model
    whose weights are gathered in bf16 (``_bf16_hooks``) computes, unsharded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return nn.functional.linear(x, w + (w.to(torch.bfloat16).float() - w).detach(), self.bias)


class RoundedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(RoundedLinear(DIM, 2 * DIM), nn.Tanh(), RoundedLinear(2 * DIM, DIM))
                                     for _ in range(2)])
        self.head = nn.Linear(DIM, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def _bf16_hooks(local: torch.Tensor, seen: list) -> None:
    """Attach extension hooks to one plain local tensor object: gather it in bf16, compute in
    ``param_dtype``. ``seen`` records the mesh each pre-all-gather call gets."""
    from torch.autograd.grad_mode import _unsafe_preserve_version_counter

    def pre(self, mesh, outer_size, outer_stride, module, mp_policy):
        seen.append((mesh.ndim, mesh.size(), mesh.mesh_dim_names))
        return (self.to(torch.bfloat16),), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        with torch.no_grad():
            if out is None:
                full = outputs[0].to(param_dtype)
                return full, (full,)
            with _unsafe_preserve_version_counter(out):  # refilled under autograd's saved tensors
                out.copy_(outputs[0])
            return None

    local.fsdp_pre_all_gather = pre.__get__(local)
    local.fsdp_post_all_gather = post.__get__(local)


def _hooks_after_to_empty(transport: str, hsdp: bool) -> dict:
    """Meta init, ``fully_shard``, ``to_empty()``, then the hooks on the new local tensors: fsdp2
    and torch's fully_shard train like the unsharded reference, and their hooks see the same meshes."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import distribute_tensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard")) if hsdp \
        else init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    models = {"ref": RoundedNet()}
    seen: dict[str, list] = {"fsdp2": [], "torch": []}
    for name, fully_shard in (("fsdp2", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        with torch.device("meta"):
            model = RoundedNet()
        with environ(CPU_COLLECTIVES_ENV, transport):
            _shard(model, fully_shard, mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for (pname, p), ref in zip(model.named_parameters(), models["ref"].parameters()):
                p.copy_(distribute_tensor(ref.detach(), p.device_mesh, p.placements))
                if "blocks" in pname and pname.endswith("weight"):  # the new objects (to_empty made them)
                    _bf16_hooks(p._local_tensor, seen[name])
        models[name] = model
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-2) for name, m in models.items()}
    for step in range(3):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        losses = {name: m(x).square().mean() for name, m in models.items()}
        for loss in losses.values():
            loss.backward()
        average_grads(models["ref"])
        for name in ("fsdp2", "torch"):
            torch.testing.assert_close(losses[name], losses["ref"], msg=lambda m: f"step {step} {name}: {m}")
        named = {name: dict(m.named_parameters()) for name, m in models.items()}
        for pname, ref in named["ref"].items():
            ours, theirs = full(named["fsdp2"][pname].grad), full(named["torch"][pname].grad)
            torch.testing.assert_close(ours, ref.grad, msg=lambda m: f"step {step} {pname} grad: {m}")
            torch.testing.assert_close(ours, theirs, atol=0, rtol=0)
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    for pname, ref in named["ref"].items():
        torch.testing.assert_close(full(named["fsdp2"][pname].detach()), ref.detach())
    return seen


@pytest.mark.parametrize("transport,hsdp", [("flat", False), ("read", False), ("exchange", True)])
def test_hooks_attached_after_to_empty_run_like_torch(transport, hsdp):
    for seen in run_on_ranks(_hooks_after_to_empty, 4 if hsdp else 2, transport, hsdp):
        # Every gather of the four block weights called the hook, with the shard axis's 1-D mesh.
        expected = (1, 2, ("shard",)) if hsdp else (1, 2, None)
        assert seen["fsdp2"] and set(seen["fsdp2"]) == {expected}, seen["fsdp2"][:4]
        assert seen["fsdp2"] == seen["torch"]


def _hooks_come_and_go() -> None:
    """Hooks on tensors that ``to_empty()`` replaced go with them (torch's fully_shard fails
    there: its outputs keep the hooks' dtype), and a late hook on a parameter sharded unevenly
    on dim 1 is refused at lazy init."""
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(4, DIM)
    torch.manual_seed(0)
    model, ref = _shard(RoundedNet(), fsdp2.fully_shard, mesh), RoundedNet()
    seen: list = []
    for pname, p in model.named_parameters():
        if "blocks" in pname and pname.endswith("weight"):
            _bf16_hooks(p._local_tensor, seen)
    model(x).sum().backward()
    assert len(seen) == 8, seen  # four weights, forward and backward
    model.to_empty(device="cpu")  # new local tensors, without the hooks: plain gathers from now on
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters()):
            p.copy_(distribute_tensor(r.detach(), p.device_mesh, p.placements))
    torch.testing.assert_close(model(x), ref(x))
    assert len(seen) == 8, seen
    model = nn.Linear(9, DIM)  # 9 columns on 2 ranks
    fsdp2.fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
    _bf16_hooks(model.weight._local_tensor, [])
    with pytest.raises(ValueError, match=r"sharded on dim 1 of size 9.*return Shard\(0\)"):
        model(torch.randn(4, 9))


def test_hooks_follow_the_local_tensors():
    run_on_ranks(_hooks_come_and_go, 2)


# ---- what the rebuild gets -----------------------------------------------------------------
class RecordsOutputs(Int8Rows):
    """Records, per rebuild, each gathered output's storage offset and whether the output
    fills its storage (an allocation of its own)."""

    outputs: list = []

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        RecordsOutputs.outputs.append([(t.storage_offset(), t.untyped_storage().nbytes() == t.numel() * t.itemsize)
                                       for t in outputs])
        return super().fsdp_post_all_gather(outputs, metadata, param_dtype, out=out)


def _gathered_outputs(transport: str) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    recorded = {}
    for name, fully_shard in (("fsdp2", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        with environ(CPU_COLLECTIVES_ENV, transport):
            model = _shard(_build(False, cls=RecordsOutputs), fully_shard, mesh)
        RecordsOutputs.outputs = []
        for _ in range(2):
            model(torch.randn(4, DIM)).sum().backward()
        recorded[name] = RecordsOutputs.outputs
    return recorded


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_gathered_outputs_are_allocations_of_their_own_like_torch(transport):
    # As torch's all-gather outputs: each at offset 0 of a storage it fills, so a rebuild may
    # pair them (torch's TwoTensor requires equal storage offsets), on every transport.
    for recorded in run_on_ranks(_gathered_outputs, 2, transport):
        assert recorded["fsdp2"] == recorded["torch"], recorded
        assert recorded["fsdp2"] and all(o == [(0, True), (0, True)] for o in recorded["fsdp2"]), recorded


# ---- state dict ---------------------------------------------------------------------------
def _state_dicts() -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ours = _shard(_build(False), fsdp2.fully_shard, mesh)
    theirs = _shard(_build(False), torch_fully_shard, mesh)
    x = torch.randn(4, DIM)
    ours(x).sum().backward()  # after a step's gathers and rebuilds too
    theirs(x).sum().backward()
    sd, torch_sd = ours.state_dict(), theirs.state_dict()
    assert sd.keys() == torch_sd.keys()
    for key, value in sd.items():
        other = torch_sd[key]
        assert isinstance(value, DTensor) and value.placements == other.placements, key
        local, torch_local = value.to_local(), other.to_local()
        assert type(local) is type(torch_local), (key, type(local), type(torch_local))
        torch.testing.assert_close(_dense(local), _dense(torch_local), atol=0, rtol=0)
    # Loading our own state dict back (copy_ into the Int8Rows shards) keeps the values.
    before = {k: _dense(v.to_local()).clone() for k, v in sd.items()}
    ours.load_state_dict(sd)
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(_dense(value.to_local()), before[key], atol=0, rtol=0)
    ours(x).sum().backward()
    # DCP saves the subclass shards as torch's fully_shard does. (Loading them back with DCP fails
    # for both in torch 2.13: its weights-only unpickler refuses the subclass.)
    import shutil
    import tempfile

    import torch.distributed.checkpoint as dcp

    where = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)
    dcp.save(ours.state_dict(), checkpoint_id=where[0])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])


def test_state_dict_holds_the_subclass_shards_like_torch():
    run_on_ranks(_state_dicts, 2)


# ---- errors -------------------------------------------------------------------------------
class PreOnly(torch.Tensor):
    """Defines the pre-all-gather hook but not the post one."""

    def fsdp_pre_all_gather(self, mesh):
        return (self,), None


class ThreeArgs(Int8Rows):
    def fsdp_pre_all_gather(self, mesh, outer_size, module):
        return (self.qdata, self.scale), None


class ReturnsTensor(Int8Rows):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return self.qdata


class ReturnsSubclass(Int8Rows):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self,), None


class WrongPostShape(Int8Rows):
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return Int8Rows(outputs[0][:3], outputs[1][:3]), tuple(outputs)


class PostReturnsTensor(Int8Rows):
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return Int8Rows(outputs[0], outputs[1])


class ChangingInputs(Int8Rows):
    calls = 0

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        ChangingInputs.calls += 1
        scale = self.scale if ChangingInputs.calls == 1 else self.scale.double()
        return (self.qdata, scale), None


def _error(build, run=True, **kwargs) -> str:
    """The error fully_shard (or, with ``run``, a forward and backward) raises: type and message."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build()
    before = [id(p) for p in model.parameters()]
    try:
        fsdp2.fully_shard(model, mesh=mesh, **kwargs)
        if run:
            for _ in range(2):
                model(torch.randn(4, DIM)).sum().backward()
    except Exception as e:  # noqa: BLE001 - the test reads it
        if not run:  # refused up front: the module is unchanged
            assert [id(p) for p in model.parameters()] == before
        return f"{type(e).__name__}: {e}"
    return "no error"


def _errors() -> dict[str, str]:
    def one(cls):
        return lambda: QuantLinear(DIM, DIM, frozen=False, cls=cls)

    def pre_only():
        m = nn.Linear(DIM, DIM)
        m.weight = nn.Parameter(torch.Tensor._make_subclass(PreOnly, torch.randn(DIM, DIM)))
        return m

    return {
        "pre_only": _error(pre_only, run=False),
        "arity": _error(one(ThreeArgs), run=False),
        # 9 columns on 2 ranks, sharded on dim 1: uneven (torch refuses it too).
        "dim": _error(lambda: QuantLinear(9, DIM, frozen=False), run=False,
                      shard_placement_fn=lambda p: Shard(p.dim() - 1)),
        "returns_tensor": _error(one(ReturnsTensor)),
        "returns_subclass": _error(one(ReturnsSubclass)),
        "post_shape": _error(one(WrongPostShape)),
        "post_tensor": _error(one(PostReturnsTensor)),
        "changing": _error(one(ChangingInputs)),
        # 9 rows on 2 ranks, and a hook that does not pad: the ranks gather different shapes.
        "uneven": _error(lambda: QuantLinear(DIM, 9, frozen=False, cls=Int8RowsV1)),
    }


def test_bad_hooks_get_clear_errors():
    errors = run_on_ranks(_errors, 2)
    for rank_errors in errors:
        e = rank_errors
        assert e["pre_only"].startswith("TypeError") and "PreOnly" in e["pre_only"] \
            and "fsdp_post_all_gather" in e["pre_only"], e["pre_only"]
        assert e["arity"].startswith("TypeError") and "ThreeArgs" in e["arity"] and "mp_policy" in e["arity"]
        assert e["dim"].startswith("ValueError") and "Shard(0)" in e["dim"], e["dim"]
        assert e["returns_tensor"].startswith("TypeError") and "ReturnsTensor" in e["returns_tensor"] \
            and "(inputs, metadata)" in e["returns_tensor"], e["returns_tensor"]
        assert e["returns_subclass"].startswith("TypeError") and "plain" in e["returns_subclass"]
        assert e["post_shape"].startswith("ValueError") and "WrongPostShape" in e["post_shape"] \
            and "(32, 32)" in e["post_shape"], e["post_shape"]
        assert e["post_tensor"].startswith("TypeError") and "inner_tensors_to_free" in e["post_tensor"]
        assert e["changing"].startswith("ValueError") and "same shapes and dtypes" in e["changing"], e["changing"]
        assert e["uneven"].startswith("ValueError") and "pad the inputs" in e["uneven"], e["uneven"]


def _int_reshard_error() -> str:
    return _error(lambda: QuantLinear(DIM, DIM, frozen=False), run=False, reshard_after_forward=2)


def test_int_reshard_after_forward_is_refused_as_in_torch():
    for e in run_on_ranks(_int_reshard_error, 4):
        assert e.startswith("NotImplementedError") and "True or False" in e, e
