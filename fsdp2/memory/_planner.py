"""``estimate_memory``: per-rank bytes of a layout, predicted before launch on one CPU.

Parameters, gradients and optimizer state are counted from shapes, with fsdp2's exact
padding (each parameter's dim 0 rounded up to a multiple of the shard ranks, 16-byte
aligned inside a group). Activations are measured, not guessed: the model runs forward and
backward once on fake tensors (no memory, no process group) while a dispatch mode counts
live storages; autograd's saved tensors are summed through ``saved_tensors_hooks``. A model
built with fewer blocks than the real one (identical blocks) is extrapolated block by block.
The fsdp2 buffers (unsharded groups, all-gather and reduce-scatter buffers) are then laid
over that activation curve at the points where the peak can happen.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from .._compat import fake_process_group, in_backward
from ..models import llama
from ..runtime._release import segment_bounds
from ._layout import OPTIMIZER_STATES, Layout, ModelBuilder, positive_int
from .._api import QuantizedComm
from ._live import LiveStorages, plain_tensors, storage_key
from ._quantized import residual_bytes, wire_bytes
from ._schedule import _add_param, _Group, _Schedule
from ._tracker import CATEGORIES, format_bytes, format_table

__all__ = ["MemoryEstimate", "Reserve", "estimate_memory"]

_MiB, _GiB = 2**20, 2**30

# What each category holds at the peak, for the table (docs/memory.md says the same).
_WHAT = {
    "sharded_params": "this rank's shard of every parameter, all step long",
    "unsharded_params": "parameters gathered for the blocks being computed or prefetched",
    "gradients": "unsharded gradients being computed, and sharded ones already reduced",
    "optimizer_state": "the optimizer's state of this rank's shards (AdamW: 2 values each)",
    "activations": "what autograd saved for backward, and the outputs of the op running",
    "communication": "all-gather and reduce-scatter buffers in flight",
    "other": "the input tokens and the model's buffers (rotary tables)",
}
_WHAT_AT_STEP = {  # at the optimizer step the categories hold other things
    "gradients": "the sharded gradients the optimizer reads",
    "other": "inputs, buffers, and the optimizer's foreach temporary (one shard-sized buffer)",
}


@dataclass(frozen=True, kw_only=True)
class Reserve:
    """What a GPU process holds besides the training step's tensors, added before saying "fits".

    The simulation counts what the step allocates through torch: parameters, gradients,
    optimizer state, activations and fsdp2's buffers. A real GPU process also holds memory the
    simulation cannot see; these are stated, typical figures (not measured by fsdp2), each
    overridable (``python -m fsdp2.plan --reserve-context ... --reserve-nccl ... --fragmentation ...``).

    Args:
        context: the CUDA context, its loaded kernels and the libraries' handles and workspaces
            (cuBLAS, cuDNN), outside torch's caching allocator. Default 1 GiB: recent GPUs with
            CUDA 12's lazy module loading show about 0.5-1 GiB per process before its first tensor.
        nccl_per_group: NCCL's buffers per communicator (one per mesh axis of more than one
            rank: dp_shard, dp_replicate, tp; at least one). Default 512 MiB: ``NCCL_BUFFSIZE``
            (4 MiB) per channel and peer connection, with up to 32 channels on NVLink; NVLink
            SHARP (H100) adds more.
        fragmentation: the caching allocator keeps more than the tensors it hands out (block
            rounding, free gaps between live blocks): this fraction of the simulated peak.
            Default 0.10; ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` usually lowers it.
    """

    context: int = _GiB
    nccl_per_group: int = 512 * _MiB
    fragmentation: float = 0.10

    def __post_init__(self) -> None:
        for name in ("context", "nccl_per_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Reserve.{name} must be a number of bytes >= 0, got {value!r}")
        if not isinstance(self.fragmentation, (int, float)) or not 0 <= self.fragmentation < 1:
            raise ValueError(f"Reserve.fragmentation must be a fraction in [0, 1), got {self.fragmentation!r}")

    @classmethod
    def none(cls) -> Reserve:
        """Nothing reserved: the verdict compares the simulated peak alone (as for a CPU run)."""
        return cls(context=0, nccl_per_group=0, fragmentation=0.0)

    def bytes(self, layout: Layout, peak: int) -> dict[str, int]:
        """The reserve for ``layout`` at a simulated ``peak``, by what it is for (zeros left out)."""
        groups = max(1, sum(n > 1 for n in (layout.dp_shard, layout.dp_replicate, layout.tp)))
        out = {"CUDA context": self.context, f"NCCL ({groups} communicator{'s' * (groups > 1)})":
               groups * self.nccl_per_group, f"allocator ({100 * self.fragmentation:.0f}% of total)":
               int(self.fragmentation * peak)}
        return {name: nbytes for name, nbytes in out.items() if nbytes}


@dataclass
class MemoryEstimate:
    """Predicted bytes on one rank: by category at the peak, where the peak is, and traffic.

    ``peak_bytes`` is the simulated step (what a ``MemoryTracker`` would measure); ``reserved``
    what the process holds besides (see :class:`Reserve`); ``needed_bytes`` their sum, which
    ``fits`` compares with ``gpu_memory``.
    """

    peak_bytes: int
    peak_by_category: dict[str, int]
    peak_point: str
    points: dict[str, int]  # every candidate point's total
    layout: str
    comm_bytes_per_step: int
    saved_activation_bytes_per_block: int
    gpu_memory: int | None = None
    notes: list[str] = field(default_factory=list)
    reserved: dict[str, int] = field(default_factory=dict)

    @property
    def needed_bytes(self) -> int:
        return self.peak_bytes + sum(self.reserved.values())

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.needed_bytes <= self.gpu_memory

    def table(self) -> str:
        what = {**_WHAT, **(_WHAT_AT_STEP if self.peak_point == "optimizer step" else {})}
        rows = [(c, format_bytes(self.peak_by_category[c]), what[c]) for c in CATEGORIES]
        rows.append(("total", format_bytes(self.peak_bytes), "the simulated step's peak"))
        if self.reserved:
            rows += [(f"+ {name}", format_bytes(nbytes), "reserved: " + _RESERVED_WHAT[name.split(" (")[0]])
                     for name, nbytes in self.reserved.items()]
            rows.append(("needed", format_bytes(self.needed_bytes), "total + reserved"))
        table = format_table([r[:2] for r in rows], ("category", "per rank at peak")).splitlines()
        notes = ["what", "----", *(r[2] for r in rows)]
        text = f"layout: {self.layout}\n" + "\n".join(f"{line}  {note}" for line, note in zip(table, notes))
        text += f"\npeak at: {self.peak_point}"
        text += f"\nsaved by autograd per block: {format_bytes(self.saved_activation_bytes_per_block)}"
        text += f"\ncommunication per step per rank: {format_bytes(self.comm_bytes_per_step)}"
        if self.gpu_memory is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            text += (f"\n{verdict} in {format_bytes(self.gpu_memory)}: needs {format_bytes(self.needed_bytes)} "
                     f"({100 * self.needed_bytes / self.gpu_memory:.0f}%)")
        return text

    __str__ = table


_RESERVED_WHAT = {
    "CUDA context": "CUDA context, kernels, cuBLAS/cuDNN handles",
    "NCCL": "NCCL buffers per communicator",
    "allocator": "caching allocator's fragmentation",
}


class _Timeline(LiveStorages):
    """Live fake storages plus fsdp2's simulated buffers, by category, op by op.

    The fake model's parameters, buffers and tokens are the baseline (``offset`` starts at
    minus their bytes): fsdp2's real parameter memory is simulated, in ``extra``. Storages
    labelled "gradients" are the fake unsharded gradients; every other fake storage is an
    activation. ``where`` names the point of the step; ``points`` keeps each point's peak.
    Under tensor parallelism the fake model is this rank's (DTensors with local shards).
    """

    def __init__(self) -> None:
        super().__init__(on_peak=self._snapshot)
        self.extra = {c: 0 for c in CATEGORIES}
        self.where = "forward, root"
        self.points: dict[str, int] = {}
        self.peak_by_category: dict[str, int] = {}
        self.peak_point = ""

    def add_bytes(self, category: str, nbytes: int) -> None:
        self.extra[category] += nbytes
        self.offset += nbytes
        self.check_peak()

    def categories(self) -> dict[str, int]:
        labelled = {c: 0 for c in CATEGORIES}
        for key, label in list(self.labels.items()):
            labelled[label] += self.sizes.get(key, 0)
        out = dict(self.extra)
        for category, nbytes in labelled.items():
            out[category] += nbytes
        out["activations"] += self.total + self.offset - sum(self.extra.values()) - sum(labelled.values())
        return out

    def label(self, t: torch.Tensor, category: str) -> None:
        """Count ``t``'s storage (registered already) under ``category`` from now on."""
        for plain in plain_tensors(t):
            key = storage_key(plain)
            if key in self.sizes:
                self.labels[key] = category

    @contextlib.contextmanager
    def born_as(self, category: str) -> Iterator[None]:
        """Storages made inside the block are ``category`` (activations otherwise)."""
        tag, self.tag = self.tag, lambda _as_input: category
        try:
            yield
        finally:
            self.tag = tag

    def forget(self, t: torch.Tensor) -> None:
        """Stop counting ``t``'s storage: fsdp2 let go of it (whoever else still holds it here)."""
        for plain in plain_tensors(t):
            key = storage_key(plain)
            if key is not None:
                self._free(key)

    def uncounted(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new fake tensor standing for memory the schedule counts apart (a shard, the
        unsharded buffer), registered with no bytes so that neither it nor ops on it add any."""
        nbytes = math.prod(shape) * dtype.itemsize
        self.offset -= nbytes  # its birth below adds as much: no new peak from it
        t = torch.empty(shape, dtype=dtype)
        key = storage_key(t)
        if key in self.sizes:
            self.total -= self.sizes[key]
            self.sizes[key] = 0
        self.offset += nbytes
        return t

    def _where(self) -> str:
        # The loss's own backward runs before the root's pre-backward hook.
        return "backward, loss" if self.where == "loss" and in_backward() else self.where

    def check_peak(self) -> None:
        now = self.total + self.offset
        where = self._where()
        if now > self.points.get(where, -1):
            self.points[where] = now
        if now > self.peak:
            self.peak = now
            self._snapshot()

    def _snapshot(self) -> None:
        self.peak_by_category, self.peak_point = self.categories(), self._where()


@dataclass
class _Run:
    per_block: int  # live bytes one block adds in forward (its saved tensors and output)
    saved_per_block: int  # what autograd saved inside one block


def _install_hooks(model: nn.Module, sched: _Schedule, line: _Timeline, activation_checkpointing: bool,
                   extra_blocks: int, block: _Group, reshard: bool,
                   saved_root: set[str]) -> tuple[list[int], dict[int, int]]:
    """Hooks that drive ``sched`` from the fake model's forward and backward."""
    blocks = model.layers
    names = {blocks[i]: f"layers.{i}" for i in range(len(blocks))}
    names[model] = "root"
    if activation_checkpointing:
        from torch.utils.checkpoint import checkpoint

        for b in blocks:
            b.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(b.forward)

    def pre_forward(module: nn.Module, *_: object) -> None:
        if not in_backward():
            sched.pre_forward(names[module])
        if module is blocks[0]:
            marks.append(line.total)

    def post_forward(module: nn.Module, _args: object, output: torch.Tensor) -> None:
        name = names[module]
        if module is blocks[0]:
            marks.append(line.total)
        if in_backward():
            return
        sched.post_forward(name)
        if module is model:
            sched.release_unsaved(saved_root)
        if module is blocks[0] and extra_blocks:  # the blocks not built run here, after block 0
            line.add_bytes("activations", extra_blocks * (marks[1] - marks[0]))
            line.add_bytes("unsharded_params", 0 if reshard else extra_blocks * block.unsharded)
        if module is model:
            line.where = "loss"
        grads = [t for t in (output if isinstance(output, tuple) else (output,)) if t.requires_grad]
        torch.autograd.graph.register_multi_grad_hook(grads, lambda _g: pre_backward(name), mode="any")

    def pre_backward(name: str) -> None:
        if name == "layers.0" and extra_blocks:  # their backward ran: gradients sharded, rest freed
            line.add_bytes("activations", -(extra_blocks * (marks[1] - marks[0])))
            line.add_bytes("unsharded_params", 0 if reshard else -extra_blocks * block.unsharded)
            if sched.grad_accum == 1:  # (else added into the earlier micro-batches', counted from the start)
                line.add_bytes("gradients", extra_blocks * block.sharded)
        # Backward reached a block: after its wait, the root's final gradients go.
        sched.pre_backward(name, None if name == "root" else lambda: sched.release_finished(
            [root_names[id(p)] for p in ready["root"]], drop_root_grads))

    root_params = {n: p for n, p in model.named_parameters() if not n.startswith("layers.")}
    root_names = {id(p): n for n, p in root_params.items()}

    def drop_root_grads(names: list[str]) -> None:
        for n in names:
            root_params[n].grad = None

    marks: list[int] = []
    for module in [model, *blocks]:
        module.register_forward_pre_hook(pre_forward)
        module.register_forward_hook(post_forward)
    ready: dict[str, list[torch.Tensor]] = {"root": []}
    for name, p in model.named_parameters():
        group = name.split(".")[0] + "." + name.split(".")[1] if name.startswith("layers.") else "root"
        ready.setdefault(group, [])
        p.register_post_accumulate_grad_hook(_grad_hook(group, ready, model, sched, line))
    saved: dict[int, int] = {}
    return marks, saved


def _grad_hook(group: str, ready: dict[str, list[torch.Tensor]], model: nn.Module, sched: _Schedule,
               line: _Timeline) -> Callable[[torch.Tensor], None]:
    members = [p for name, p in model.named_parameters() if p.requires_grad and (
        name.startswith(group + ".") if group != "root" else not name.startswith("layers."))]

    def hook(p: torch.Tensor) -> None:
        for plain in plain_tensors(p.grad):  # a DTensor's local tensor under TP
            key = storage_key(plain)
            if key in line.sizes:
                line.labels[key] = "gradients"
        ready[group].append(p)
        if len(ready[group]) == len(members):
            def drop() -> None:
                for q in members:
                    # The quantized reduction's temporaries come after the gradients are freed,
                    # while autograd still holds the last one until this hook returns: not counted.
                    if q.grad is not None and sched.policy is not None:
                        line.forget(q.grad)
                    q.grad = None
            sched.post_backward(group, drop)
            line.check_peak()
    return hook


def _simulate(model: nn.Module, sched: _Schedule, line: _Timeline, layout: Layout, builder: ModelBuilder,
              extra_blocks: int, block: _Group) -> _Run:
    """One forward, loss and backward of the fake model under the schedule."""
    # The root's parameters forward saves (views included; tensor-parallel ones are never freed
    # after forward): with early release, the rest of the root is freed after forward
    # (EarlyRelease.forward_done).
    saved_root = {n for n, p in model.named_parameters() if not n.startswith("layers.") and isinstance(p, DTensor)}
    marks, _ = _install_hooks(model, sched, line, layout.activation_checkpointing, extra_blocks, block,
                              layout.reshard_after_forward, saved_root)
    param_keys = {storage_key(plain) for p in model.parameters() for plain in plain_tensors(p)}
    root_keys = {storage_key(plain): n for n, p in model.named_parameters() if not n.startswith("layers.")
                 for plain in plain_tensors(p)}
    saved: dict[int, int] = {}
    in_block = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        for plain in plain_tensors(t):
            key = storage_key(plain)
            if key in root_keys:
                saved_root.add(root_keys[key])
            if in_block[0] and key is not None and key not in param_keys:
                saved[key] = plain.untyped_storage().nbytes()
        return t

    model.layers[0].register_forward_pre_hook(lambda *_: in_block.__setitem__(0, True))
    model.layers[0].register_forward_hook(lambda *_: in_block.__setitem__(0, False))
    tokens = builder.make_inputs(layout.batch, layout.seq)
    line.extra["other"] += tokens.untyped_storage().nbytes()
    for t in [*model.parameters(), *model.buffers(), tokens]:
        line.add(t)
    line.offset = sum(line.extra.values()) - line.total  # the fake parameters are not fsdp2's memory
    with line, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = builder.loss_fn(model(tokens), tokens)
        loss.backward()
        sched.end_backward()
    return _Run(marks[1] - marks[0], sum(saved.values()))


def estimate_memory(layout: Layout, model: ModelBuilder | Callable[[], nn.Module] | None = None, *,
                    gpu_memory: int | None = None, reserve: Reserve | None = None) -> MemoryEstimate:
    """Predict one rank's peak memory for training a model with fsdp2 on ``layout``.

    The model is sharded as the recipe does: each of ``model.layers`` is one group, the root
    takes the rest. One forward, loss and backward run on fake tensors (nothing allocated);
    hooks replay fsdp2's buffer schedule around them (see ``_Schedule``), and the peak and
    its split into categories are read op by op, as ``MemoryTracker`` does on a real run.

    Args:
        layout: mesh sizes, precision, resharding, optimizer, batch and sequence (``Layout``).
        model: a ``ModelBuilder``, or a function building the model (``ModelBuilder(build=model)``);
            default ``ModelBuilder.llama("llama3_8b")``, the recipe's Llama at Llama 3 8B.
        gpu_memory: bytes available per rank, to say whether it fits.
        reserve: what a GPU process holds besides the step (CUDA context, NCCL, allocator
            fragmentation; see :class:`Reserve`), added to the peak for the verdict. Default:
            ``Reserve()`` for ``backend="nccl"``, nothing for ``"gloo"`` (a CPU run);
            ``Reserve.none()`` compares the simulated peak alone.

    With ``layout.tp > 1`` the fake model is tensor-parallelised by the builder's ``tp_plan``
    and runs as one rank of the TP group does, on a fake process group of ``tp`` ranks (so
    there must be no default process group in this process); every byte is this rank's.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"estimate_memory(layout, model): layout must be a fsdp2.memory.Layout, got "
                        f"{type(layout).__name__}; e.g. Layout(world=8, batch=1, seq=8192)")
    builder = _as_builder(model)
    if gpu_memory is not None:
        positive_int("estimate_memory", "gpu_memory", gpu_memory)
    if reserve is None:
        reserve = Reserve() if layout.backend == "nccl" else Reserve.none()
    elif not isinstance(reserve, Reserve):
        raise TypeError(f"estimate_memory(reserve=...) takes a fsdp2.memory.Reserve, got {type(reserve).__name__}")
    shard = layout.dp_shard
    with contextlib.ExitStack() as stack:
        module, tp_mesh = _build(builder, layout.tp, stack)
        n_built = len(module.layers)
        n_blocks = builder.num_blocks or n_built
        if n_blocks < n_built or (n_blocks > n_built and n_built < 2):
            raise ValueError(f"num_blocks ({n_blocks}) needs a model built with at least 2 and at most "
                             f"num_blocks blocks; it has {n_built}")
        if tp_mesh is not None:
            _apply_tp(module, tp_mesh, builder.tp_plan)
        orig_dtype = next(module.parameters()).dtype
        pdtype = layout.param_dtype or orig_dtype
        rdtype = layout.reduce_dtype or pdtype
        sizes = _group_sizes(module, shard, pdtype, rdtype)
        root_params, root_segments = _root_parts(module, shard, pdtype, rdtype)
        block, root = sizes["layers.0"], sizes["root"]
        constants, shard_values = _constants(module, sizes, n_blocks - n_built, layout.optimizer, layout.grad_accum,
                                             shard, layout.comm_policy)
        if pdtype != orig_dtype:
            _cast_parameters(module, pdtype)
        line = _Timeline()
        alias = shard == 1 and layout.dp_replicate == 1 and layout.tp == 1 and pdtype == orig_dtype
        sched = _Schedule(line, sizes, ["root", *(f"layers.{i}" for i in range(n_built))], shard=shard,
                          alias=alias, reshard=layout.reshard_after_forward,
                          root_reshard=layout.root_reshard_after_forward, grad_accum=layout.grad_accum,
                          gloo=layout.backend == "gloo", reads=layout.cpu_reads, root_params=root_params,
                          root_segments=root_segments, early_release=layout.root_early_release,
                          policy=layout.comm_policy, reduce_dtype=rdtype, replicas=layout.dp_replicate)
        for category, nbytes in constants.items():
            line.extra[category] += nbytes
        run = _simulate(module, sched, line, layout, builder, n_blocks - n_built, block)
        model_dim = _model_dim(module)
    step = _optimizer_step(constants, shard_values, layout.optimizer)
    line.points["optimizer step"] = sum(step.values())
    if sum(step.values()) > line.peak:
        line.peak, line.peak_by_category, line.peak_point = sum(step.values()), step, "optimizer step"
    comm = _comm_bytes(root, block, n_blocks, layout, model_dim=model_dim, act_itemsize=pdtype.itemsize)
    notes = [f"tensor parallelism simulated with {'the given tp_plan' if builder.tp_plan else 'the recipe Llama plan'}"
             ] if layout.tp > 1 else []
    return MemoryEstimate(line.peak, {c: line.peak_by_category.get(c, 0) for c in CATEGORIES}, line.peak_point,
                          dict(line.points), _describe(layout, n_blocks, pdtype), comm, run.saved_per_block,
                          gpu_memory, notes, reserve.bytes(layout, line.peak))


def _as_builder(model: ModelBuilder | Callable[[], nn.Module] | None) -> ModelBuilder:
    if isinstance(model, ModelBuilder):
        return model
    return ModelBuilder.llama() if model is None else ModelBuilder(build=model)


def _build(builder: ModelBuilder, tp: int, stack: contextlib.ExitStack) -> tuple[nn.Module, DeviceMesh | None]:
    """The model on fake tensors (and, with ``tp > 1``, a TP mesh on a fake process group)."""
    tp_mesh = None
    if tp > 1:  # DTensor needs a mesh, hence a process group; a fake one moves no data
        stack.enter_context(fake_process_group(tp))
        tp_mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    # Non-fake inputs allowed: the model's, loss's or inputs' functions may close over plain tensors.
    stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    model = builder.build()
    if not isinstance(model, nn.Module):
        raise TypeError(f"ModelBuilder.build() must return an nn.Module, got {type(model).__name__}")
    if not all(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()]):
        # Made before the call (it would be changed in place): not what a builder is for.
        raise TypeError("ModelBuilder.build() returned a model made before the call (its tensors are not fake); "
                        "make a new one inside the function, e.g. build=lambda: Model(args)")
    _off_meta(model)
    if not isinstance(getattr(model, "layers", None), nn.ModuleList) or len(model.layers) == 0:
        raise ValueError("estimate_memory needs a model whose blocks are in a non-empty nn.ModuleList `.layers`")
    return model, tp_mesh


def _off_meta(model: nn.Module) -> None:
    """A model built on the meta device gets fake CPU tensors instead (tied ones stay tied).

    As ``to_empty(device="cpu")``, which cannot be used here: under the fake mode the meta
    tensors are fake too, and ``nn.Module._apply`` cannot swap fake tensors.
    """
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta tensor, kept alive; its fake CPU one)
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in moved:
                    empty = torch.empty_like(t, device="cpu")
                    moved[id(t)] = t, nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty
                table[name] = moved[id(t)][1]


def _group_sizes(model: nn.Module, shard: int, pdtype: torch.dtype, rdtype: torch.dtype) -> dict[str, _Group]:
    """Each fsdp2 group's bytes: one per block of ``model.layers``, the root the rest."""
    sizes = {"root": _Group()}
    for name, p in model.named_parameters():
        group = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        _add_param(sizes.setdefault(group, _Group()), p, shard, pdtype, rdtype)
    return sizes


def _root_parts(model: nn.Module, shard: int, pdtype: torch.dtype,
                rdtype: torch.dtype) -> tuple[dict[str, _Group], list[list[str]]]:
    """The root's parameters' bytes one by one (by name), and its segments (names each), cut as
    ``ParamGroup`` cuts them for early release: one per module owning a run of its parameters."""
    parts: dict[str, _Group] = {}
    owners = []
    for name, p in model.named_parameters():
        if not name.startswith("layers."):
            _add_param(parts.setdefault(name, _Group()), p, shard, pdtype, rdtype)
            owners.append(model.get_submodule(name.rpartition(".")[0]))
    names = list(parts)
    bounds = segment_bounds(owners, [parts[n].unsharded for n in names])
    return parts, [names[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def _cast_parameters(model: nn.Module, pdtype: torch.dtype) -> None:
    """As ``MixedPrecisionPolicy``: the unsharded (floating-point) parameters in ``param_dtype``.

    A parameter shared by two modules (tied embeddings) stays one parameter.
    """
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.dtype.is_floating_point:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(pdtype), p.requires_grad)
                module._parameters[name] = cast[id(p)]


def _describe(layout: Layout, n_blocks: int, pdtype: torch.dtype) -> str:
    return (f"world {layout.world} = dp_replicate {layout.dp_replicate} x dp_shard {layout.dp_shard} x tp {layout.tp}; "
            f"{n_blocks} blocks; batch {layout.batch} x seq {layout.seq}; param {str(pdtype).removeprefix('torch.')}; "
            f"reshard_after_forward={layout.reshard_after_forward}; "
            f"activation_checkpointing={layout.activation_checkpointing}")


def _constants(model: nn.Module, sizes: dict[str, _Group], extra_blocks: int, optimizer: str,
               grad_accum: int, shard: int, policy: QuantizedComm | None) -> tuple[dict[str, int], int]:
    """Bytes live for the whole step (shards, optimizer state, error-feedback residuals, buffers
    and inputs), and the shards' values."""
    groups = [*sizes.values(), *[sizes["layers.0"]] * extra_blocks]
    sharded = sum(g.sharded for g in groups)
    # AdamW's states are zeros_like the sharded parameters, plus a 4-byte step per tensor.
    steps = sum(len(g.entries) for g in groups) * 4 if optimizer != "sgd" else 0
    states = OPTIMIZER_STATES[optimizer] * sharded + steps
    other = sum(b.untyped_storage().nbytes() for b in model.buffers())  # the inputs: added by _simulate
    return dict(sharded_params=sum(g.shard_storage(shard) for g in groups), optimizer_state=states, other=other,
                gradients=sharded if grad_accum > 1 else 0,
                communication=sum(residual_bytes(g, policy, shard) for g in groups)), sharded


def _optimizer_step(constants: dict[str, int], shard_values: int, optimizer: str) -> dict[str, int]:
    """The optimizer step: shards, their gradients, states, and foreach temporaries (other)."""
    out = {c: 0 for c in CATEGORIES}
    out.update(sharded_params=constants["sharded_params"], optimizer_state=constants["optimizer_state"],
               gradients=shard_values, communication=constants["communication"],  # (inputs freed by then)
               other=constants["other"] + (shard_values if optimizer != "sgd" else 0))
    return out


def _model_dim(model: nn.Module) -> int:
    norm = getattr(model, "norm", None)
    weight = getattr(norm, "weight", None)
    return weight.shape[0] if weight is not None else 0


def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: Callable[[nn.Module, DeviceMesh], None] | None) -> None:
    """Tensor parallelism on the fake model: ``tp_plan``, or the Llama's own (``fsdp2.models.llama.tp_plan``)."""
    tp = tp_mesh.size()
    args = getattr(model, "args", None)
    if args is not None:
        heads, kv = args.n_heads, getattr(args, "kv_heads", args.n_heads)
        if heads % tp or kv % tp:
            raise ValueError(f"tp ({tp}) must divide the attention heads ({heads}) and kv heads ({kv})")
    if tp_plan is None and not isinstance(model, llama.Transformer):
        raise ValueError(
            f"estimate_memory(tp > 1) needs the tensor-parallel plan of {type(model).__name__}: pass "
            "ModelBuilder(build=..., tp_plan=fn) with fn(model, tp_mesh) applying its parallelize_module plan "
            "(only fsdp2.models.llama.Transformer has a default, its tp_plan)"
        )
    (tp_plan or llama.tp_plan)(model, tp_mesh)


def _comm_bytes(root: _Group, block: _Group, n_blocks: int, layout: Layout, model_dim: int,
                act_itemsize: int) -> int:
    """Bytes each rank receives per step (ring collectives: (n - 1) / n of the full size)."""
    def frac(n: int) -> float:
        return (n - 1) / n

    shard, replicate, tp, reshard = layout.dp_shard, layout.dp_replicate, layout.tp, layout.reshard_after_forward
    ac, batch, seq = layout.activation_checkpointing, layout.batch, layout.seq
    # The root is gathered once; blocks again in backward when resharded after forward.
    (root_g, root_r, root_a), (block_g, block_r, block_a) = (
        wire_bytes(g, layout.comm_policy, shard, replicate) for g in (root, block))
    all_gather = (root_g + block_g * n_blocks * (2 if reshard else 1)) * frac(shard)
    reduce_scatter = (root_r + block_r * n_blocks) * frac(shard)
    all_reduce = frac(replicate) * (root_a + block_a * n_blocks)
    # Sequence-parallel TP: per block 2 all-gathers + 2 reduce-scatters of (batch, seq, dim) in
    # forward, as many in backward, and the forward ones again when recomputing.
    tp_traffic = (4 * (3 if ac else 2) * n_blocks * batch * seq * model_dim * act_itemsize * frac(tp)) if tp > 1 else 0
    return int(all_gather + reduce_scatter + all_reduce + tp_traffic)
