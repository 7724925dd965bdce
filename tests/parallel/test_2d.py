"""2-D data parallelism: HSDP (replicate x shard meshes) and FSDP x tensor parallelism.

HSDP runs on a (dp_replicate=2, dp_shard=2) mesh; FSDP x TP on a (dp=2, tp=2) mesh with a
Llama-style model (RMSNorm, attention with separate q/k/v/o projections, a SwiGLU
feed-forward) given to ``parallelize_module`` on ``mesh["tp"]`` before ``fully_shard`` on
``mesh["dp"]``; 3-D is HSDP x TP on (dp_replicate, dp_shard, tp) over 8 ranks. Every
data-parallel rank trains on its own data and TP peers on the same data; the unsharded
reference averages its gradients over all ranks, which (TP peers adding identical copies)
is the data-parallel average.
"""

from __future__ import annotations

import copy
import logging
import functools
from typing import Any, Callable

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
)

import fsdp2
from tests._dist import run_on_ranks
from tests._models import lm_loss, make_batch
from tests._parity import assert_params_match, average_grads, full

VOCAB, DIM, HEADS, SEQ = 32, 16, 4, 8
ATOL = 1e-4  # fp32; TP splits matmuls, so sums run in a different order than the reference's


# ---- a Llama-style model ----------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1: every head, or this rank's share of them under TP. (batch, heads, seq, head_dim)
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU. w1 and w2 carry biases, so TP also shards (w1) and replicates (w2) 1-D parameters."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, n_heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.ffn = FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, n_layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.tok_emb = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(LlamaBlock(DIM, HEADS) for _ in range(n_layers))
            self.norm = nn.RMSNorm(DIM)
            self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (batch, seq) -> logits: (batch, seq, vocab)
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def _batch(dp_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(dp_rank, step, seq=SEQ, vocab=VOCAB)


# ---- meshes and parallelization ---------------------------------------------------------
@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    # Cached per rank process: every rank makes the same meshes in the same order.
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _hsdp_mesh() -> DeviceMesh:
    return _mesh((2, 2), ("dp_replicate", "dp_shard"))


def _tp_mesh() -> DeviceMesh:
    return _mesh((2, 2), ("dp", "tp"))


def _block_plan(sequence_parallel: bool) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(), "ffn.w1": ColwiseParallel(), "ffn.w2": RowwiseParallel(),
        "ffn.w3": ColwiseParallel(),
    }
    if sequence_parallel:  # norms run on sequence shards; attention and MLP gather the sequence
        gather_seq = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({
            "attn_norm": SequenceParallel(), "attn": gather_seq, "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(), "ffn": gather_seq, "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def _root_sp_plan() -> dict[str, Any]:
    return {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def _parallelize(model: Llama, mesh: DeviceMesh, dp_axes: str | tuple[str, ...], *,
                 sequence_parallel: bool = False, fully_shard: Callable = fsdp2.fully_shard,
                 **kwargs: Any) -> Llama:
    """TP on ``mesh["tp"]`` first (it makes the DTensors FSDP shards), then FSDP: blocks, then root."""
    tp_mesh, dp_mesh = mesh["tp"], mesh[dp_axes]
    if sequence_parallel:
        parallelize_module(model, tp_mesh, _root_sp_plan())
    for block in model.layers:
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)
    return model


def _shard_hsdp(model: Llama, **kwargs: Any) -> Llama:
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=_hsdp_mesh(), **kwargs)
    fsdp2.fully_shard(model, mesh=_hsdp_mesh(), **kwargs)
    return model


# ---- training against the reference ----------------------------------------------------
def _train_vs_reference(
    model: nn.Module, ref: nn.Module, dp_rank: int, *, steps: int = 2, micro: int = 1,
    configure: Callable[[nn.Module, bool], None] | None = None,
    clip: Callable[[nn.Module], torch.Tensor] | None = None, atol: float = ATOL,
) -> list[list[str]]:
    """AdamW steps on ``model`` and the unsharded ``ref``; assert losses and parameters agree (two
    steps: the second's loss is computed from parameters the first step updated).

    ``micro`` micro-batches per step (``configure(model, last)`` before each); ``clip``, if
    given, computes the sharded model's total gradient norm (with max_norm 1, so it clips),
    checked against the reference's. Returns each micro-batch's ``record_schedule`` events.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    schedules = []
    for step in range(steps):
        for m in range(micro):
            inputs, targets = _batch(dp_rank, step * micro + m)
            ref_loss = lm_loss(ref(inputs), targets)
            ref_loss.backward()
            if configure is not None:
                configure(model, m == micro - 1)
            with fsdp2.record_schedule() as events:
                loss = lm_loss(model(inputs), targets)
                loss.backward()
            schedules.append(list(events))
            torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=atol, rtol=atol,
                                       msg=lambda msg: f"step {step} micro {m} loss: {msg}")
        average_grads(ref)
        for name, p in model.named_parameters():  # gradients come back laid out like the parameters
            assert (p.grad.device_mesh, p.grad.placements) == (p.device_mesh, p.placements), name
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0)
            torch.testing.assert_close(full(clip(model)), ref_norm, atol=atol, rtol=atol)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    assert_params_match(ref, model, atol=atol, rtol=atol)
    return schedules


def _tp_parity(sequence_parallel: bool = False, micro: int = 1, accumulate: bool = False,
               reshard_after_forward: bool | None = None, clip: str | None = None) -> list[list[str]]:
    mesh = _tp_mesh()
    ref = Llama()
    kwargs = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    model = _parallelize(copy.deepcopy(ref), mesh, "dp", sequence_parallel=sequence_parallel, **kwargs)
    configure = None
    if accumulate:
        def configure(m: nn.Module, last: bool) -> None:
            m.set_requires_gradient_sync(last)
    clip_fn = None
    if clip == "torch":
        def clip_fn(m: nn.Module) -> torch.Tensor:
            return torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1.0)
    elif clip == "fsdp2":
        def clip_fn(m: nn.Module) -> torch.Tensor:
            return fsdp2.clip_grad_norm_(m.parameters(), max_norm=1.0)
    return _train_vs_reference(model, ref, mesh["dp"].get_local_rank(), micro=micro,
                               configure=configure, clip=clip_fn)


def _all_agree(per_rank: list) -> Any:
    assert all(r == per_rank[0] for r in per_rank), per_rank
    return per_rank[0]


def _collectives(events: list[str]) -> list[str]:
    return [e for e in events if e.split()[0] in ("reduce_scatter", "all_reduce")]


def _count(events: list[str], kind: str) -> int:
    return sum(e.startswith(kind + " ") for e in events)


# ---- HSDP -------------------------------------------------------------------------------
def _hsdp_parity(accumulate: bool) -> list[list[str]]:
    ref = Llama()
    model = _shard_hsdp(copy.deepcopy(ref))

    def configure(m: nn.Module, last: bool) -> None:
        m.set_requires_all_reduce(last)

    return _train_vs_reference(model, ref, dist.get_rank(), micro=2 if accumulate else 1,
                               configure=configure if accumulate else None)


@pytest.mark.slow
def test_hsdp_matches_reference():
    run_on_ranks(_hsdp_parity, 4, False)


class TestHSDPAccumulation(expecttest.TestCase):
    def test_all_reduce_only_on_last_micro_batch(self):
        # set_requires_all_reduce(False) on the first micro-batch: every group still
        # reduce-scatters within its replica, but nothing crosses replicas until the last.
        # A group's all-reduce runs when its reduce-scatter is finished, which the reduce
        # queue (one in flight) does once the next group's reduce-scatter is issued.
        schedules = _all_agree(run_on_ranks(_hsdp_parity, 4, True))
        first, last = schedules[0], schedules[1]
        self.assertExpectedInline("\n".join(_collectives(first)), """\
reduce_scatter layers.1
reduce_scatter layers.0
reduce_scatter root""")
        self.assertExpectedInline("\n".join(_collectives(last)), """\
reduce_scatter layers.1
all_reduce layers.1
reduce_scatter layers.0
all_reduce layers.0
reduce_scatter root
all_reduce root""")


# ---- FSDP x TP --------------------------------------------------------------------------
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tp_matches_reference(sequence_parallel):
    run_on_ranks(_tp_parity, 4, sequence_parallel)


def _tp_3d_parity() -> None:
    mesh = _mesh((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))
    ref = Llama(n_layers=1)
    model = _parallelize(copy.deepcopy(ref), mesh, ("dp_replicate", "dp_shard"))
    dp_rank = mesh["dp_replicate"].get_local_rank() * 2 + mesh["dp_shard"].get_local_rank()
    _train_vs_reference(model, ref, dp_rank)


@pytest.mark.slow  # 8 ranks
def test_hsdp_tp_3d_matches_reference():
    run_on_ranks(_tp_3d_parity, 8, timeout=240.0)


def _layout_lines(model: nn.Module) -> list[str]:
    return [f"{name:<26} {','.join(p.device_mesh.mesh_dim_names)}: {tuple(p.placements)} "
            f"{tuple(p.shape)} {tuple(p.to_local().shape)}"
            for name, p in model.named_parameters()]


def _placements() -> dict[str, list[str]]:
    """Each parameter's mesh, placements, global and local shape, for fsdp2 and torch's FSDP2."""
    out = {}
    for sp in (False, True):
        ours = _layout_lines(_parallelize(Llama(n_layers=1), _tp_mesh(), "dp", sequence_parallel=sp))
        theirs = _layout_lines(_parallelize(Llama(n_layers=1), _tp_mesh(), "dp", sequence_parallel=sp,
                                            fully_shard=torch_fully_shard))
        assert ours == theirs, (ours, theirs)
        out["tp_sp" if sp else "tp"] = ours
    return out


class TestPlacements(expecttest.TestCase):
    def test_tp_fsdp_placements(self):
        # Colwise weights and biases: TP already splits dim 0, so the dp shard is strided
        # (_StridedShard) and full_tensor() reassembles the true tensor. Rowwise weights:
        # TP splits dim 1, dp plain Shard(0). Parameters TP leaves alone: the dp mesh only.
        # Local shapes are rank 0's.
        layouts = run_on_ranks(_placements, 4)[0]
        self.assertExpectedInline("\n".join(layouts["tp"]), """\
tok_emb.weight             dp: (Shard(dim=0),) (32, 16) (16, 16)
layers.0.attn_norm.weight  dp: (Shard(dim=0),) (16,) (8,)
layers.0.attn.wq.weight    dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (16, 16) (4, 16)
layers.0.attn.wk.weight    dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (16, 16) (4, 16)
layers.0.attn.wv.weight    dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (16, 16) (4, 16)
layers.0.attn.wo.weight    dp,tp: (Shard(dim=0), Shard(dim=1)) (16, 16) (8, 8)
layers.0.ffn_norm.weight   dp: (Shard(dim=0),) (16,) (8,)
layers.0.ffn.w1.weight     dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (32, 16) (8, 16)
layers.0.ffn.w1.bias       dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (32,) (8,)
layers.0.ffn.w2.weight     dp,tp: (Shard(dim=0), Shard(dim=1)) (16, 32) (8, 16)
layers.0.ffn.w2.bias       dp,tp: (Shard(dim=0), Replicate()) (16,) (8,)
layers.0.ffn.w3.weight     dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (32, 16) (8, 16)
norm.weight                dp: (Shard(dim=0),) (16,) (8,)
output.weight              dp: (Shard(dim=0),) (32, 16) (16, 16)""")
        self.assertExpectedInline("\n".join(layouts["tp_sp"]), """\
tok_emb.weight             dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (32, 16) (8, 16)
layers.0.attn_norm.weight  dp,tp: (Shard(dim=0), Replicate()) (16,) (8,)
layers.0.attn.wq.weight    dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (16, 16) (4, 16)
layers.0.attn.wk.weight    dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (16, 16) (4, 16)
layers.0.attn.wv.weight    dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (16, 16) (4, 16)
layers.0.attn.wo.weight    dp,tp: (Shard(dim=0), Shard(dim=1)) (16, 16) (8, 8)
layers.0.ffn_norm.weight   dp,tp: (Shard(dim=0), Replicate()) (16,) (8,)
layers.0.ffn.w1.weight     dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (32, 16) (8, 16)
layers.0.ffn.w1.bias       dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (32,) (8,)
layers.0.ffn.w2.weight     dp,tp: (Shard(dim=0), Shard(dim=1)) (16, 32) (8, 16)
layers.0.ffn.w2.bias       dp,tp: (Shard(dim=0), Replicate()) (16,) (8,)
layers.0.ffn.w3.weight     dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (32, 16) (8, 16)
norm.weight                dp,tp: (Shard(dim=0), Replicate()) (16,) (8,)
output.weight              dp,tp: (_StridedShard(dim=0, sf=2), Shard(dim=0)) (32, 16) (8, 16)""")


# ---- utilities on 2-D parameters --------------------------------------------------------
def test_tp_clip_grad_norm_all_2d_matches_reference():
    # With sequence parallel every parameter is a DTensor on the (dp, tp) mesh.
    run_on_ranks(_tp_parity, 4, True, clip="torch")


def _clip_warnings() -> list[str]:
    """DTensor's warnings about reducing a norm while fsdp2.clip_grad_norm_ runs on (dp, tp) gradients
    (and matches the reference). Gathering (_StridedShard, Shard) parameters whole (the test's own
    comparison) warns too, rightly: not counted."""
    from torch.distributed.tensor import _redistribute

    # torch warns once per process and mesh axes; this worker may have warned in an earlier test.
    getattr(_redistribute, "_warned_flatten_issues", set()).clear()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(_redistribute.__name__)
    logger.addHandler(handler)
    try:
        _tp_parity(True, clip="fsdp2")
    finally:
        logger.removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING and "_NormPartial" in r.getMessage()]


def test_tp_clip_grad_norm_reduces_a_2d_norm_in_one_all_reduce_without_warnings():
    # Gradients sharded on dp and tp have a norm partial on both axes; reduced one axis at a time,
    # DTensor warns on every rank ("2 sequential all_reduce operations ... flatten mesh dimensions").
    assert run_on_ranks(_clip_warnings, 4) == [[]] * 4


def test_tp_clip_grad_norm_mixed_1d_2d_matches_reference():
    # Without sequence parallel the embedding and norms are sharded on dp only.
    assert callable(fsdp2.clip_grad_norm_)
    run_on_ranks(_tp_parity, 4, False, clip="fsdp2")


def test_tp_gradient_accumulation_matches_reference():
    schedules = _all_agree(run_on_ranks(_tp_parity, 4, False, micro=2, accumulate=True))
    # No reduce-scatter while gradient sync is off; every group's on the synced micro-batch.
    assert [_count(events, "reduce_scatter") for events in schedules] == [0, 3] * 2, schedules


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_tp_reshard_after_forward_matches_reference(reshard_after_forward):
    schedules = _all_agree(run_on_ranks(_tp_parity, 4, False, reshard_after_forward=reshard_after_forward))
    # The root and both blocks: gathered in forward, and again in backward only if resharded.
    assert {_count(events, "unshard") for events in schedules} == {6 if reshard_after_forward else 3}


def _tp_mixed_precision_vs_torch() -> dict[str, float]:
    """bf16 parameters, fp32 reduction: fsdp2 and torch's fully_shard on the same 2-D layout."""
    mesh = _tp_mesh()
    base = Llama()
    policies = (fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    models = [_parallelize(copy.deepcopy(base), mesh, "dp", fully_shard=shard, mp_policy=policy)
              for shard, policy in zip((fsdp2.fully_shard, torch_fully_shard), policies)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    diffs = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(3):
        inputs, targets = _batch(mesh["dp"].get_local_rank(), step)
        losses = [lm_loss(m(inputs), targets) for m in models]
        for loss in losses:
            loss.backward()
        diffs["loss"] = max(diffs["loss"], (losses[0] - losses[1]).abs().item())
        for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert p.grad.dtype == p.dtype == torch.float32, name
            assert (p.grad.placements, p.grad.to_local().shape) == (q.grad.placements, q.grad.to_local().shape)
            diffs["grad"] = max(diffs["grad"], (p.grad.to_local() - q.grad.to_local()).abs().max().item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        diffs["param"] = max(diffs["param"], (p.full_tensor() - q.full_tensor()).abs().max().item())
    return diffs


def test_tp_mixed_precision_matches_torch():
    for diffs in run_on_ranks(_tp_mixed_precision_vs_torch, 4):
        assert diffs == {"loss": 0.0, "grad": 0.0, "param": 0.0}, diffs


# ---- DCP between the 2-D and the 1-D layout ---------------------------------------------
def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v) for k, v in model.state_dict().items()}


def _assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = _full_state(a), _full_state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    # Same weights in different layouts compute the same function (on the same batch everywhere).
    inputs, targets = _batch(0, 0)
    with torch.no_grad():
        torch.testing.assert_close(lm_loss(a(inputs), targets), lm_loss(b(inputs), targets), atol=ATOL, rtol=ATOL)


def _load(model: nn.Module, path: str) -> None:
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)


def _dcp_2d_to_1d_and_back(path: str) -> None:
    one_d = _mesh((4,), ("dp",))

    def build_1d(seed: int) -> Llama:
        model = Llama(seed=seed)
        for block in model.layers:
            fsdp2.fully_shard(block, mesh=one_d)
        return fsdp2.fully_shard(model, mesh=one_d)

    two_d = _parallelize(Llama(seed=1), _tp_mesh(), "dp")
    dcp.save(two_d.state_dict(), checkpoint_id=f"{path}/2d")
    flat = build_1d(seed=2)
    _load(flat, f"{path}/2d")
    _assert_same_model(flat, two_d)

    back = _parallelize(Llama(seed=3), _tp_mesh(), "dp")
    _train_steps(flat)  # new values, so the way back cannot pass by leftovers
    dcp.save(flat.state_dict(), checkpoint_id=f"{path}/1d")
    _load(back, f"{path}/1d")
    _assert_same_model(back, flat)


def _train_steps(model: nn.Module) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = _batch(dist.get_rank(), 0)
    lm_loss(model(inputs), targets).backward()
    opt.step()


def test_dcp_2d_to_1d_and_back(tmp_path):
    run_on_ranks(_dcp_2d_to_1d_and_back, 4, str(tmp_path))


# ---- collective counts ------------------------------------------------------------------
def _collective_counts(layout: str) -> list[str]:
    """One training step's collectives per kind, and the ranks (of this rank's groups) they span."""
    if layout == "hsdp":
        model, mesh = _shard_hsdp(Llama()), _hsdp_mesh()
        shard_axis, replicate_axis, dp_rank = "dp_shard", "dp_replicate", dist.get_rank()
    else:
        mesh = _tp_mesh()
        model = _parallelize(Llama(), mesh, "dp")
        shard_axis, replicate_axis, dp_rank = "dp", None, mesh["dp"].get_local_rank()
    inputs, targets = _batch(dp_rank, 0)
    with fsdp2.record_schedule() as events:
        lm_loss(model(inputs), targets).backward()
    counts = [f"{kind}={_count(events, kind)}" for kind in ("unshard", "reduce_scatter", "all_reduce")]
    # Which axis: every group gathers and reduce-scatters over the shard axis, all-reduces over
    # the replicate axis.
    groups = [fsdp2_state.group for fsdp2_state in _states(model)]
    shard_ranks = {tuple(dist.get_process_group_ranks(g.process_group)) for g in groups}
    replicate_ranks = {tuple(dist.get_process_group_ranks(g.dp.replicate_group))
                       for g in groups if g.dp.replicate_group is not None}
    assert shard_ranks == {tuple(dist.get_process_group_ranks(mesh.get_group(shard_axis)))}, shard_ranks
    expected_replicate = set() if replicate_axis is None else \
        {tuple(dist.get_process_group_ranks(mesh.get_group(replicate_axis)))}
    assert replicate_ranks == expected_replicate, replicate_ranks
    return counts


def _states(model: nn.Module) -> list[Any]:
    from fsdp2.runtime._state import get_state

    return [get_state(m) for m in model.modules() if get_state(m) is not None]


class TestCollectiveCounts(expecttest.TestCase):
    def test_hsdp(self):
        # Forward gathers the root (kept for backward) and each block; backward gathers each
        # block again. Each of the 3 groups reduce-scatters once and all-reduces once.
        counts = _all_agree(run_on_ranks(_collective_counts, 4, "hsdp"))
        self.assertExpectedInline(" ".join(counts), """unshard=5 reduce_scatter=3 all_reduce=3""")

    def test_tp(self):
        # Same gathers and reduce-scatters over the dp axis; no replicate axis, no all-reduce.
        # (TP's own collectives are DTensor's, over the tp axis, and not FSDP events.)
        counts = _all_agree(run_on_ranks(_collective_counts, 4, "tp"))
        self.assertExpectedInline(" ".join(counts), """unshard=5 reduce_scatter=3 all_reduce=0""")


# ---- clear errors -----------------------------------------------------------------------
def _snapshot(module: nn.Module) -> list[tuple]:
    return [(name, type(m), [(n, id(p)) for n, p in m._parameters.items()],
             len(m._forward_pre_hooks), len(m._forward_hooks))
            for name, m in module.named_modules()]


def _rejected(case: str, match: str) -> None:
    """A bad 2-D ``fully_shard`` raises ValueError matching ``match`` and leaves the module unchanged."""
    block = LlamaBlock(DIM, HEADS)
    if case == "foreign_tp_mesh":  # TP from another init_device_mesh call, its tp axis overlapping dp
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
        parallelize_module(block, other["tp"], _block_plan(False))
        call = functools.partial(fsdp2.fully_shard, block, mesh=_tp_mesh()["dp"])
    elif case == "tp_on_dp_axis":
        parallelize_module(block, _tp_mesh()["dp"], _block_plan(False))
        call = functools.partial(fsdp2.fully_shard, block, mesh=_tp_mesh()["dp"])
    elif case == "unnamed_hsdp_mesh":
        call = functools.partial(fsdp2.fully_shard, block, mesh=DeviceMesh("cpu", torch.arange(4).view(2, 2)))
    else:  # an int reshard_after_forward must divide the dp axis and differ from 1 and its size: dp=4, tp=1
        mesh = _mesh((4, 1), ("dp", "tp"))
        parallelize_module(block, mesh["tp"], _block_plan(False))
        call = functools.partial(fsdp2.fully_shard, block, mesh=mesh["dp"], reshard_after_forward=2)
    before = _snapshot(block)
    with pytest.raises(ValueError, match=match):
        call()
    assert _snapshot(block) == before
    assert not isinstance(block, fsdp2.FSDPModule)


@pytest.mark.parametrize("case, match", [
    ("foreign_tp_mesh", r"cannot be joined with the data-parallel mesh.*"
                        r"parallelize_module\(block, mesh\['tp'\], plan\)"),
    ("tp_on_dp_axis", r"cannot be joined with the data-parallel mesh"),
    ("unnamed_hsdp_mesh", r"needs axis names.*mesh_dim_names=\('dp_replicate', 'dp_shard'\)"),
    ("int_reshard_with_tp", r"reshard_after_forward=2 \(int\) is not supported with tensor-parallel"
                            r".*use True or False"),
])
def test_2d_errors(case, match):
    run_on_ranks(_rejected, 4, case, match)


def _rebuilt_equal_mesh() -> None:
    """An identical mesh from a second init_device_mesh call works like the first.

    DTensor's caches may give the TP parameters a mesh sliced from the earlier, equal root.
    """
    first = _tp_mesh()
    parallelize_module(LlamaBlock(DIM, HEADS), first["tp"], _block_plan(False))
    again = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = Llama(n_layers=1)
    model = _parallelize(copy.deepcopy(ref), again, "dp")
    _train_vs_reference(model, ref, again["dp"].get_local_rank(), steps=1)


def test_tp_mesh_rebuilt_equal_is_accepted():
    run_on_ranks(_rebuilt_equal_mesh, 4)
