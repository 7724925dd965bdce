"""torch.compile with fully_shard: the three ways to compile, each trained against eager fsdp2
and against torch's fully_shard compiled the same way.

1. ``torch.compile(block)`` (the wrapper module) per block, then ``fully_shard``;
2. ``block.compile(fullgraph=True)`` in place per block, then ``fully_shard`` (torchtitan's
   way, and the recipe's ``--training.compile``), with inductor;
3. ``torch.compile(model)`` of the whole model after ``fully_shard``.

For each: losses and every parameter after two AdamW steps match eager fsdp2 and torch's
``fully_shard``; the schedule fsdp2 records (all-gathers, reshards, reduce-scatters) is the
eager one, so its hooks ran eagerly; no frame of fsdp2's code appears in any captured
graph; Dynamo broke the graph exactly where it does for torch's FSDP2. Also: the markers
Dynamo and transformers look for (``_is_fsdp_managed_module``) on exactly the modules
torch's fully_shard marks, and gone again after a failed ``fully_shard``; a backward under
compiled autograd refused with a clear error, and training going on after it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import fsdp2
import fsdp2.runtime._fully_shard as _fully_shard_module
from tests._dist import run_on_ranks
from tests._models import MLP, Transformer, lm_loss, make_batch
from tests._parity import full

STEPS = 2


class _Recorder:
    """A Dynamo backend that keeps every graph it is given, then hands it to ``backend``."""

    def __init__(self, backend: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.compile = lookup_backend(backend)
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        self.graphs.append(gm)
        return self.compile(gm, example_inputs)

    def traced_files(self) -> set[str]:
        """Every source file a captured op came from (its stack trace's ``File "..."`` lines)."""
        files = set()
        for gm in self.graphs:
            for node in gm.graph.nodes:
                for line in (node.meta.get("stack_trace") or "").splitlines():
                    line = line.strip()
                    if line.startswith('File "'):
                        files.add(line.split('"')[1])
        return files


def _compiled(model: nn.Module, mode: str | None, shard: Callable, backend: Any) -> nn.Module:
    """Compile ``model`` the way ``mode`` says and shard it; return what to call."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if mode == "wrapper":
        for i, block in enumerate(model.layers):
            model.layers[i] = torch.compile(block, backend=backend)
    elif mode == "in_place":
        for block in model.layers:
            block.compile(backend=backend, fullgraph=True)
    for block in model.layers:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return torch.compile(model, backend=backend) if mode == "whole" else model


def _train(base: nn.Module, mode: str | None, shard: Callable, backend: str) -> dict[str, Any]:
    """Two AdamW steps on this rank's batches; losses, parameters, schedule and Dynamo's record."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    recorder = _Recorder(backend)
    model = copy.deepcopy(base)
    run = _compiled(model, mode, shard, recorder)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, schedule = [], []
    for step in range(STEPS):
        tokens, targets = make_batch(dist.get_rank(), step)
        with fsdp2.record_schedule() as events:
            loss = lm_loss(run(tokens), targets)
            loss.backward()
        schedule.append(events)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "params": [full(p).detach() for p in model.parameters()],
        "schedule": schedule,
        "graphs": len(recorder.graphs),
        "files": recorder.traced_files(),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def _compile_parity(mode: str, backend: str, atol: float) -> None:
    base = Transformer(n_layers=2, dim=32, n_heads=4)
    eager = _train(base, None, fsdp2.fully_shard, backend)
    ours = _train(base, mode, fsdp2.fully_shard, backend)
    theirs = _train(base, mode, torch_fully_shard, backend)

    assert ours["graphs"] >= 1, "nothing was compiled"
    assert ours["graphs"] == theirs["graphs"] and ours["graph_breaks"] == theirs["graph_breaks"], (ours, theirs)
    fsdp2_dir = fsdp2.__file__.rsplit("/", 1)[0] + "/"
    traced = sorted(f for f in ours["files"] if f.startswith(fsdp2_dir))
    assert not traced, f"fsdp2 code was traced into a graph: {traced}"
    assert any(f.endswith("tests/_models.py") for f in ours["files"]), ours["files"]
    # Hooks ran eagerly: the same gathers, reshards and reduce-scatters as without compile.
    assert ours["schedule"] == eager["schedule"]
    assert any(e.startswith("unshard layers.1") for e in ours["schedule"][0]), ours["schedule"][0]

    for other, tol in ((eager, atol), (theirs, 1e-6)):
        torch.testing.assert_close(ours["losses"], other["losses"], atol=tol, rtol=tol)
        for p, q in zip(ours["params"], other["params"]):
            torch.testing.assert_close(p, q, atol=tol, rtol=tol)


@pytest.mark.slow  # Dynamo and inductor compile on every rank
@pytest.mark.parametrize("mode, backend, atol", [
    ("wrapper", "aot_eager", 1e-6),
    ("in_place", "inductor", 1e-4),  # inductor fuses: rounding differs from eager a little
    ("whole", "aot_eager", 1e-6),
])
def test_compiled_training_matches_eager_and_torch(mode, backend, atol):
    run_on_ranks(_compile_parity, 2, mode, backend, atol, timeout=600)


# ---- the markers Dynamo and the ecosystem read ---------------------------------------------
_MARKERS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _marked(model: nn.Module) -> list[str]:
    return [name or "root" for name, m in model.named_modules()
            if all(m.__dict__.get(k) is True for k in _MARKERS)]


def _markers_match_torch() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def build() -> nn.Module:
        model = Transformer(n_layers=2, dim=16, n_heads=2)
        model.layers[0].mlp.act = nn.ReLU()  # parameterless: torch drops it when ignored_params is given
        return model

    for kwargs in ({}, {"ignored_params": "mlp"}):
        marked = []
        for shard in (fsdp2.fully_shard, torch_fully_shard):
            model = build()
            extra = {}
            if kwargs:  # every parameter of layers.1's MLP: the MLP module is then not managed
                extra["ignored_params"] = set(model.layers[1].mlp.parameters())
            shard(model.layers[0], mesh=mesh, **extra)
            assert _marked(model) == [n for n in _marked(model) if n.startswith("layers.0")]
            shard(model, mesh=mesh, **extra)
            marked.append(_marked(model))
        assert marked[0] == marked[1], marked
        assert "root" in marked[0] and "layers.0.mlp.in_proj" in marked[0]


def test_managed_markers_match_torch():
    run_on_ranks(_markers_match_torch, 2)


def _markers_rolled_back() -> None:
    model = nn.Sequential(MLP(8), MLP(8))
    fsdp2.fully_shard(model[0])
    before = _marked(model)
    with pytest.raises(ValueError, match="must divide the mesh size"):  # refused before anything changes
        fsdp2.fully_shard(model[1], reshard_after_forward=3)
    assert _marked(model) == before == ["0", "0.in_proj", "0.out_proj"]
    # A failure after the markers were set (here: in the class swap, the last step) removes them.
    model = nn.Sequential(MLP(8), MLP(8))
    fsdp2.fully_shard(model[0])
    real_swap = _fully_shard_module._swap_class

    def failing_swap(module: nn.Module) -> None:
        raise RuntimeError("swap failed")

    _fully_shard_module._swap_class = failing_swap
    try:
        with pytest.raises(RuntimeError, match="swap failed"):
            fsdp2.fully_shard(model)
    finally:
        _fully_shard_module._swap_class = real_swap
    assert _marked(model) == before
    assert not isinstance(model, fsdp2.FSDPModule)
    fsdp2.fully_shard(model)  # and the module is as it was: sharding it now works
    assert _marked(model) == ["root", *before, "1", "1.in_proj", "1.out_proj"]


def test_markers_removed_when_fully_shard_fails():
    run_on_ranks(_markers_rolled_back, 2)


# ---- compiled autograd: refused clearly ------------------------------------------------------
def _compiled_autograd_refused() -> None:
    from torch._dynamo import compiled_autograd

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # One block: compiled autograd makes a fake tensor of each tensor the backward saved, before the
    # first hook refuses it (two blocks took twice the seconds).
    model = Transformer(n_layers=1, dim=16, n_heads=2)
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    tokens, targets = make_batch(dist.get_rank(), 0)
    loss = lm_loss(model(tokens), targets)
    with pytest.raises(RuntimeError, match="fsdp2 does not support compiled autograd"):
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
    # The interrupted iteration is reset by the next forward: training goes on eagerly.
    with fsdp2.record_schedule() as events:
        lm_loss(model(tokens), targets).backward()
    assert sum(e.startswith("reduce_scatter") for e in events) == 2, events  # the block's and the root's


@pytest.mark.slow
def test_compiled_autograd_is_refused_clearly():
    run_on_ranks(_compiled_autograd_refused, 2)
