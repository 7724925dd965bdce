"""Pipeline parallelism (``torch.distributed.pipelining``) with fsdp2-sharded stages.

4 gloo ranks as pp 2 x dp 2 (``init_device_mesh("cpu", (2, 2), ("pp", "dp"))``). The stages are
torchtitan's decoder after its pipeline split (the first holds ``tok_embeddings``, the last
``norm`` and ``lm_head``; each has layers and a parameter of the stage's own), sharded as
torchtitan's ``apply_fsdp_to_decoder`` does with pipelining on: ``tok_embeddings``, each layer
and ``[norm, lm_head]`` in groups that keep their parameters after forward
(``reshard_after_forward=False``: one all-gather per step, not one per microbatch), then the
stage; gradient divide factor 1 (torchtitan normalises the loss itself). One slow test calls
torchtitan's function itself. Every schedule torch ships (all run on CPU), 2 and 4 microbatches,
one stage per rank and two (looped; the V schedules put stages 0 and 3 on rank 0).

Four runs of the same model, data and schedule:

* ``torch``: torch's ``fully_shard`` (summed reduce-scatters, ``set_force_sum_reduction_for_comms``:
  gloo has no PREMUL_SUM);
* ``patched``: the same code under ``fsdp2.patch_torch()``, so pipelining drives fsdp2 as it
  drives torch's FSDP2: the same collectives per step, bit-exact losses and parameters;
* ``direct``: ``fsdp2.fully_shard`` imported directly, which pipelining does not recognise:
  correct with more collectives and a warning, or (split backward: fsdp2 drives the stage
  itself) with torch's collectives and no warning;
* ``ref``: the pipeline unsharded, its gradients summed over dp with ``all_reduce``.
"""

from __future__ import annotations

import functools
import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp2
from tests._dist import run_on_ranks

DIM, LAYERS_PER_STAGE, BATCH = 8, 2, 8
STEPS = 2  # the first step also infers the stages' shapes; the second is the steady state
REF_TOLERANCE = dict(atol=1e-5, rtol=1e-5)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class _Stage(nn.Module):
    """One pipeline stage, named as torchtitan's decoder after its pipeline split: the first stage
    has the input projection (``tok_embeddings``), the last the head (``norm``, ``lm_head``)."""

    enable_weight_tying = False

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Linear(DIM, DIM) if first else None
        self.layers = nn.ModuleDict({str(i): _Layer() for i in range(LAYERS_PER_STAGE)})
        self.norm = nn.LayerNorm(DIM) if last else None
        self.lm_head = nn.Linear(DIM, DIM) if last else None
        self.gate = nn.Parameter(torch.ones(DIM))  # the root group's own parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        x = x * self.gate
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def _stages_of_rank(schedule: str, per_rank: int, pp_rank: int, pp: int) -> list[int]:
    if per_rank == 1:
        return [pp_rank]
    if schedule in ("ZBVZeroBubble", "DualPipeV"):  # the V: down the ranks, then back up
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def _build_stages(num_stages: int) -> list[_Stage]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return [_Stage(i == 0, i == num_stages - 1) for i in range(num_stages)]


def _shard(stage: _Stage, route: str, mesh, titan: bool, param_dtype: torch.dtype) -> None:
    """torchtitan's apply_fsdp_to_decoder with pipelining on (``titan``: torchtitan's own function)."""
    if route == "ref":
        return
    if route == "direct":
        shard, module_type, policy = fsdp2.fully_shard, fsdp2.FSDPModule, fsdp2.MixedPrecisionPolicy
    else:  # torch's names: torch's own, or fsdp2's while patched
        from torch.distributed.fsdp import FSDPModule as module_type
        from torch.distributed.fsdp import MixedPrecisionPolicy as policy
        from torch.distributed.fsdp import fully_shard as shard
    if titan:
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        apply_fsdp_to_decoder(stage, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, pp_enabled=True)
    else:
        shard = functools.partial(shard, mp_policy=policy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                                          cast_forward_inputs=False))
        if stage.tok_embeddings is not None:
            shard(stage.tok_embeddings, mesh=mesh, reshard_after_forward=False)
        if stage.lm_head is not None:
            shard([stage.norm, stage.lm_head], mesh=mesh, reshard_after_forward=False)
        for layer in stage.layers.values():
            shard(layer, mesh=mesh, reshard_after_forward=False)
        shard(stage, mesh=mesh)
    for module in stage.modules():
        if isinstance(module, module_type):
            module.set_gradient_divide_factor(1.0)
            if route == "torch":
                module.set_force_sum_reduction_for_comms(True)


def _schedule_class(name: str):
    import torch.distributed.pipelining.schedules as schedules

    return getattr(schedules, f"Schedule{name}")


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


def _full(stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for index, stage in stages.items():
            for name, p in stage.named_parameters():
                out[f"{index}.{name}"] = (p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone()
    return out


def _comm_counter():
    """``CommDebugMode``'s collective counts, without its module tracker.

    The tracker hooks every module's inputs with ``register_multi_grad_hook``, which fails inside
    the ``torch.autograd.grad`` calls pipelining makes on leaf inputs (metadata inference, the
    zero-bubble input pass): "A leaf node was passed to _will_engine_execute_node".
    """
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(CommDebugMode):
        def __enter__(self):
            super().__enter__()
            self.advanced_module_tracker.__exit__()
            return self

        def __exit__(self, *args):
            TorchDispatchMode.__exit__(self, *args)

    return Counter()


def _count_comms(mode) -> dict[str, int]:
    return {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items() if n}


@functools.cache
def _mesh(pp: int, world: int):
    """The (pp, dp) mesh, made once per rank process: every route and test reuses its process groups
    (a mesh per run added 6 gloo threads to each worker, and the pool was restarted every ten tests)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (pp, world // pp), mesh_dim_names=("pp", "dp"))


def _train(route: str, schedule: str, n_microbatches: int, per_rank: int, steps: int = STEPS, pp: int = 2,
           titan: bool = False, param_dtype: torch.dtype = torch.float32) -> dict:
    """Train the pipeline ``steps`` AdamW steps on this rank; what it ends with."""
    from torch.distributed.pipelining import PipelineStage

    mesh = _mesh(pp, dist.get_world_size())
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    num_stages = pp * per_rank
    every = _build_stages(num_stages)
    mine = {i: every[i] for i in _stages_of_rank(schedule, per_rank, pp_rank, pp)}
    handle = fsdp2.patch_torch() if route == "patched" else None
    logged = _Records()
    logging.getLogger("fsdp2.runtime._pipeline").addHandler(logged)
    try:
        for module in mine.values():
            _shard(module, route, mesh["dp"], titan, param_dtype)
        stages = [PipelineStage(module, i, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
                  for i, module in mine.items()]
        cls = _schedule_class(schedule)
        sched = cls(stages[0] if per_rank == 1 and schedule in ("GPipe", "1F1B") else stages,
                    n_microbatches=n_microbatches, loss_fn=_loss)
        params = [p for module in mine.values() for p in module.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses, comms = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * step + dp_rank)
            x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, DIM, generator=g)
            x = x.to(param_dtype)  # (torchtitan's policy casts no inputs)
            step_losses: list[torch.Tensor] = []
            is_first, is_last = 0 in mine, num_stages - 1 in mine
            kwargs = {}
            if is_last:
                kwargs.update(target=y, losses=step_losses)
            with _comm_counter() as mode:
                if is_first:
                    sched.step(x, **kwargs)
                else:
                    sched.step(**kwargs)
            comms.append(_count_comms(mode))
            if route == "ref":
                for p in params:
                    dist.all_reduce(p.grad, group=mesh["dp"].get_group())
            opt.step()
            opt.zero_grad()
            if step_losses:
                losses.append(torch.stack([loss.detach() for loss in step_losses]))
    finally:
        logging.getLogger("fsdp2.runtime._pipeline").removeHandler(logged)
        if handle is not None:
            handle.undo()
    return {"losses": losses, "params": _full(mine), "comms": comms, "stages": len(mine),
            "warned": [r.getMessage() for r in logged.records]}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def _skip_self_send(schedule: str) -> None:
    """torch 2.11's pipelining opens a V schedule's step by sending to the neighbouring stage on
    the same rank, which gloo cannot ("Pair is not connected"), on every route, torch's own too."""
    if schedule in V_SCHEDULES and tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
        pytest.skip("torch 2.11's pipelining sends a V schedule's stages on one rank messages to "
                    "themselves, which gloo cannot (\"Pair is not connected\"), on torch's own FSDP2 too")


def _all_routes(schedule: str, n_microbatches: int, per_rank: int, titan: bool = False,
                param_dtype: torch.dtype = torch.float32, routes: tuple[str, ...] | None = None) -> dict:
    """Every route on this rank, or ``routes`` (``titan``: the stages sharded by torchtitan's own
    function, not the direct route; bf16: torch's and patched only)."""
    if routes is None:
        routes = ("torch", "patched")
        if param_dtype == torch.float32:
            routes += ("ref",) + (("direct",) if not titan else ())
    with warnings.catch_warnings():
        # torch 2.13's FSDP2 warns that a stage returns a view (LayerNorm's output under Linear): no in-place op follows
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
        return {route: _train(route, schedule, n_microbatches, per_rank, titan=titan, param_dtype=param_dtype)
                for route in routes}


def _check(results: list[dict], split: bool = False) -> None:
    """Patched: torch's collectives, and its numbers bit for bit; patched and direct: the unsharded
    pipeline's within float tolerance; direct with a split backward (``split``): torch's
    collectives and no warning."""
    for rank, out in enumerate(results):
        torch_run, patched = out["torch"], out.get("patched")
        if patched is not None:
            assert patched["comms"] == torch_run["comms"], (rank, patched["comms"], torch_run["comms"])
            assert len(patched["losses"]) == len(torch_run["losses"])
            for a, b in zip(patched["losses"], torch_run["losses"]):
                assert torch.equal(a, b), (rank, a, b)
            assert patched["params"].keys() == torch_run["params"].keys()
            for name, value in patched["params"].items():
                assert torch.equal(value, torch_run["params"][name]), (rank, name, value, torch_run["params"][name])
            assert patched["warned"] == [], (rank, patched["warned"])
        for route in ("patched", "direct"):
            if route not in out or "ref" not in out:
                continue
            for a, b in zip(out[route]["losses"], out["ref"]["losses"]):
                torch.testing.assert_close(a, b, **REF_TOLERANCE)
            for name, value in out[route]["params"].items():
                torch.testing.assert_close(value, out["ref"]["params"][name], **REF_TOLERANCE,
                                           msg=lambda m, name=name, route=route: f"{route} {name}: {m}")
        if "direct" in out and split:  # fsdp2 drives the stage as pipelining drives torch's: its collectives
            # (but the first step's shape inference, after which pipelining reshards torch's stages only)
            direct = out["direct"]["comms"]
            assert direct[1:] == torch_run["comms"][1:], (rank, direct, torch_run["comms"])
            first = torch_run["comms"][0]
            assert all(direct[0].get(op, 0) <= n for op, n in first.items()), (rank, direct, torch_run["comms"])
            assert out["direct"]["warned"] == [], (rank, out["direct"]["warned"])
        elif "direct" in out:  # pipelining drives it not: one all-gather and reduce-scatter pair a microbatch
            warned = out["direct"]["warned"]
            assert len(warned) == out["direct"]["stages"] and all("fsdp2.patch_torch()" in w for w in warned), warned
            direct, steps = out["direct"]["comms"], len(torch_run["comms"])
            assert all(direct[s]["_reduce_scatter_base_"] > torch_run["comms"][s]["_reduce_scatter_base_"]
                       for s in range(steps)), (rank, direct, torch_run["comms"])



MATRIX = [(s, n, 1) for s in ("GPipe", "1F1B") for n in (2, 4)] + [
    (s, n, k) for s in ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble") for n in (2, 4) for k in (1, 2)
] + [("ZBVZeroBubble", n, 2) for n in (2, 4)] + [("DualPipeV", 4, 2)]  # (it needs a microbatch per stage)


@pytest.mark.slow
@pytest.mark.parametrize("schedule,n_microbatches,per_rank", MATRIX)
def test_pipeline_matches_torch(schedule, n_microbatches, per_rank):
    _skip_self_send(schedule)
    _check(run_on_ranks(_all_routes, 4, schedule, n_microbatches, per_rank, timeout=300),
           split=schedule in SPLIT_BACKWARD)


def test_direct_import_split_backward_quick():
    """The quick subset of a split backward imported directly: the last stage's input and weight
    passes (the first stage's weight pass is a full backward); torch's collectives, the unsharded
    pipeline's numbers."""
    _check(run_on_ranks(_all_routes, 4, "InterleavedZeroBubble", 2, 1, routes=("torch", "direct", "ref"),
                        timeout=300), split=True)


def test_last_backward_needs_a_counting_schedule():
    """A schedule that does not count its backward passes as torch's runtime ones do says nothing
    (the direct route then refuses it with an error naming patch_torch())."""
    from fsdp2 import _compat

    assert _compat.pipeline_last_backward(object(), object()) is None


def test_pipeline_quick():
    """The quick subset: one schedule with a full backward, every route."""
    _check(run_on_ranks(_all_routes, 4, "1F1B", 2, 1, timeout=300))


def test_patch_rebinds_pipelining_names():
    """pipelining's modules, imported before the patch, see fsdp2's names while patched and torch's after."""
    import torch.distributed.fsdp as torch_fsdp
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    originals = (torch_fsdp.FSDPModule, torch_fsdp.fully_shard, torch_fsdp.UnshardHandle)
    with fsdp2.patch_torch():
        assert stage.FSDPModule is fsdp2.FSDPModule and stage.fully_shard is fsdp2.fully_shard
        assert schedules.FSDPModule is fsdp2.FSDPModule and schedules.UnshardHandle is fsdp2.UnshardHandle
    assert (stage.FSDPModule, stage.fully_shard, schedules.UnshardHandle) == originals


def test_fully_shard_state_needs_a_sharded_module():
    with pytest.raises(ValueError, match="fully_shard.state: Linear was not passed to fully_shard"):
        fsdp2.fully_shard.state(nn.Linear(2, 2))


@pytest.mark.slow
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_pipeline_with_torchtitans_apply_fsdp(param_dtype):
    """torchtitan's own ``apply_fsdp_to_decoder`` (pipelining on) shards the stages, under the patch;
    also with bf16 parameters and fp32 reductions (torchtitan's default), bit for bit torch's too."""
    pytest.importorskip("torchtitan")
    _skip_self_send("ZBVZeroBubble")
    _check(run_on_ranks(_all_routes, 4, "ZBVZeroBubble", 4, 2, True, param_dtype, timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("schedule,n_microbatches,per_rank", [("1F1B", 4, 1), ("InterleavedZeroBubble", 4, 2)])
def test_pipeline_mixed_precision_matches_torch(schedule, n_microbatches, per_rank):
    """bf16 parameters, fp32 reductions: the same collectives, bit for bit torch's. With a split
    backward that needs fsdp2's end of backward to keep, as torch's does, the bf16 gradients a
    weight pass set on groups that backward did not reach in fp32 before the next adds to them."""
    _check(run_on_ranks(_all_routes, 4, schedule, n_microbatches, per_rank, False, torch.bfloat16, timeout=300))
