"""``QuantizedComm`` with the features issue #29 names besides HSDP and mixed precision (those
are in test_quantized_comm.py): FSDP x TP, gradient accumulation, checkpointing.

- FSDP x TP (4 ranks, dp=2 x tp=2, ``parallelize_module`` then ``fully_shard`` on ``mesh["dp"]``):
  the quantized collectives run over the dp axis on each TP rank's local tensors; the
  sharded parameters keep the unquantized run's placements and fp32.
- Gradient accumulation: with ``set_requires_gradient_sync(False)`` the unsharded gradients
  add up unreduced and are quantized **once**, on the synced micro-batch (one all-to-all);
  with sync on every micro-batch each one is quantized and reduced and the results add into
  ``.grad`` (error feedback carrying its residual from one micro-batch to the next).
- Checkpoints hold the sharded fp32 parameters and optimizer state, never the quantized
  values; a resume is bit-identical without error feedback. The error-feedback residuals are
  not part of ``state_dict()`` (each rank's own, per parameter): a resume starts them at zero
  and drifts slightly from the uninterrupted run (bounded below; docs/quantized-comm.md).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp2
from fsdp2.runtime._state import get_state
from tests._dist import run_on_ranks
from tests._models import MLP, Transformer, lm_loss, train_steps
from tests._parity import full
from tests.runtime.test_quantized_comm import BOTH8, _packed_rows

# ---- FSDP x TP -----------------------------------------------------------------------------------


def _tp_train(policy: fsdp2.QuantizedComm | None, steps: int) -> dict:
    from tests.parallel.test_2d import Llama, _batch, _parallelize, _tp_mesh
    mesh = _tp_mesh()
    model = _parallelize(Llama(n_layers=1), mesh, "dp", comm_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grad_layouts = [], set()
    with fsdp2.count_comm_bytes() as sent:
        for _ in range(steps):
            inputs, targets = _batch(mesh["dp"].get_local_rank(), 0)  # one batch: the loss must fall
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            for p in model.parameters():  # gradients laid out like their parameters
                grad_layouts.add((p.grad.device_mesh, p.grad.placements) == (p.device_mesh, p.placements))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    layout = [(name, type(p).__name__, str(p.dtype), p.device_mesh.mesh_dim_names, str(p.placements),
               tuple(p.shape), tuple(p.to_local().shape)) for name, p in model.named_parameters()]
    adam = {str(v.dtype) for s in opt.state.values() for k, v in s.items() if k != "step"}
    transports = {(get_state(m).group.gather_transport.name, get_state(m).group.reduce_transport.name)
                  for m in model.modules() if isinstance(m, fsdp2.FSDPModule)}
    return {"losses": losses, "layout": layout, "grad_layouts": grad_layouts, "adam": adam,
            "sent": (sent.all_gather, sent.reduce_scatter), "transports": transports,
            "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()}}


def _tp_quantized_against_plain(steps: int) -> dict:
    return {"off": _tp_train(None, steps), "on": _tp_train(BOTH8, steps)}


def test_fsdp_x_tp_trains_quantized_with_the_same_layout():
    """dp=2 x tp=2, int8 weights and gradients over dp: losses within 1% of the unquantized
    run's at every step (measured <= 0.1% over 3 steps), parameters and AdamW state fp32
    DTensors with the unquantized run's meshes, placements and local shapes (the strided dp
    shards of TP's colwise weights included), gradients laid out like them; about a quarter
    of the bytes on both collectives."""
    steps = 3
    results = run_on_ranks(_tp_quantized_against_plain, 4, steps)
    for rank, r in enumerate(results):
        off, on = r["off"], r["on"]
        assert on["layout"] == off["layout"], rank
        assert {row[1] for row in on["layout"]} == {"DTensor"}
        assert {row[2] for row in on["layout"]} == {"torch.float32"} and on["adam"] == {"torch.float32"}
        assert {row[3] for row in on["layout"]} == {("dp",), ("dp", "tp")}  # TP'd and plain parameters both
        assert on["grad_layouts"] == {True}
        assert on["transports"] == {("flat", "flat")}
        for a, b in zip(off["losses"], on["losses"]):
            assert abs(a - b) <= 0.01 * a, (off["losses"], on["losses"])
        assert off["losses"] != on["losses"]  # it did quantize
        assert on["losses"][-1] < on["losses"][0]
        (off_ag, off_rs), (on_ag, on_rs) = off["sent"], on["sent"]
        assert 0.25 < on_ag / off_ag < 0.35 and 0.25 < on_rs / off_rs < 0.30, (off["sent"], on["sent"])
        # one step moves an element by about lr (AdamW); quantization flips few of them
        diff = max((off["params"][n] - on["params"][n]).abs().max().item() for n in off["params"])
        assert 0 < diff <= 2 * steps * 1e-2 * 1.01
    # TP peers compute the same losses; dp ranks their own
    assert results[0]["on"]["losses"] == results[1]["on"]["losses"]


# ---- gradient accumulation -----------------------------------------------------------------------
MICRO = 3
BLOCK = 32


def _one_bound(rows_by_rank: list[torch.Tensor], world: int) -> torch.Tensor:
    """Half a scale per element of one quantized reduction: each source rank's rows (``(world,
    total)``, rank-major) by block, ``absmax / 254``, summed over the sources, over ``world``."""
    bound = torch.zeros_like(rows_by_rank[0])
    n = bound.shape[1]
    for rows in rows_by_rank:
        blocked = nn.functional.pad(rows, (0, -(-n // BLOCK) * BLOCK - n)).view(world, -1, BLOCK)
        bound += (blocked.abs().amax(dim=2, keepdim=True) / 254).expand_as(blocked).reshape(world, -1)[:, :n]
    return bound / world


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _residual_rows(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad_residual for p in get_state(model).group.params], dim=1)


def _accumulate(feedback: bool) -> dict:
    """``MICRO`` micro-batches (different data per rank and micro-batch) on MLP(40, 50), int8
    gradients (block 32), three ways: no sync until the last (``nosync``), sync on every one
    (``every``), and sync on every one with ``.grad`` cleared in between, the reduced gradients
    summed here (``separate``). Against the exact average of the ranks' accumulated gradients."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    plain = MLP(40, 50)
    xs = [torch.randn(6, 40, generator=torch.Generator().manual_seed(100 * m + dist.get_rank())) * (1 + m)
          for m in range(MICRO)]
    local = []  # this rank's own gradient of each micro-batch, unreduced, rank-major rows
    for x in xs:
        plain(x).pow(2).sum().backward()
        local.append(_packed_rows([p.grad.clone() for p in plain.parameters()], world))
        plain.zero_grad()
    acc = sum(local[1:], local[0].clone())  # added in the order autograd adds them
    every_acc = [_gathered(rows) for rows in local]  # [micro][source rank]
    every_rank_acc = _gathered(acc)
    exact = sum(every_rank_acc) / world
    policy = fsdp2.QuantizedComm(gradients="int8", block_size=BLOCK, error_feedback=feedback)
    out: dict = {}
    for mode in ("nosync", "every", "separate"):
        model = copy.deepcopy(plain)
        fsdp2.fully_shard(model, mesh=mesh, comm_policy=policy)
        calls, summed = [], None
        for m, x in enumerate(xs):
            if mode == "nosync":
                model.set_requires_gradient_sync(m == MICRO - 1)
            with fsdp2.count_comm_bytes() as sent:
                model(x).pow(2).sum().backward()
            calls.append(sent.calls["reduce_scatter"])
            if mode == "separate":
                reduced = _packed_rows([full(p.grad) for p in model.parameters()], world)
                summed = reduced if summed is None else summed + reduced
                model.zero_grad()
        got = summed if mode == "separate" else _packed_rows([full(p.grad) for p in model.parameters()], world)
        out[mode] = {"calls": calls, "got": got, "err": (got - exact).abs()}
        if feedback:
            # What each rank sent plus what it kept adds up to what it had: the sum over the ranks
            # of their residuals and ``world`` times the reduced gradient is the sum of their inputs.
            out[mode]["residuals"] = _gathered(_residual_rows(model))
    out["one_bound"] = _one_bound(every_rank_acc, world)  # one quantization of the accumulated sums
    out["micro_bound"] = sum(_one_bound(rows, world) for rows in every_acc)  # one per micro-batch
    out["exact"], out["every_acc"], out["every_rank_acc"] = exact, every_acc, every_rank_acc
    out["same_every_separate"] = torch.equal(out["every"]["got"], out["separate"]["got"])
    return out


def _accumulation_both() -> dict:
    return {False: _accumulate(False), True: _accumulate(True)}


def test_gradient_accumulation_quantizes_once_per_sync():
    """Without sync the unsharded gradients add up and the synced micro-batch quantizes their
    sum once: one all-to-all, each element within one quantization's bound (``absmax / 254``
    of the accumulated block, summed over the ranks, over the world) of the exact average.
    With sync on every micro-batch each is quantized (one all-to-all each) and ``.grad`` is
    the sum of the reduced gradients, bit for bit (as with ``.grad`` cleared and the results
    summed), within the sum of the micro-batches' bounds. Error feedback: nothing to carry at
    the first quantization (no-sync: the same result as without it); with sync on every
    micro-batch the residual carries to the next micro-batch, so the total telescopes:
    ``world * reduced + sum of the ranks' residuals == sum of the ranks' inputs``."""
    world = 2
    results = run_on_ranks(_accumulation_both, world)
    for r in results:
        for feedback in (False, True):
            res = r[feedback]
            nosync, every = res["nosync"], res["every"]
            assert nosync["calls"] == [0] * (MICRO - 1) + [1]  # quantized and sent once
            assert every["calls"] == res["separate"]["calls"] == [1] * MICRO
            slack = 1e-5 * res["exact"].abs() + 1e-6
            assert (nosync["err"] <= res["one_bound"] + slack).all(), (nosync["err"] - res["one_bound"]).max()
            assert (every["err"] <= res["micro_bound"] + slack).all()
            assert res["same_every_separate"]  # reduced gradients add into .grad as they are
            assert not torch.equal(nosync["got"], every["got"])  # quantizing the sum is not the sum of quantized
            assert nosync["err"].max() > 0 and every["err"].max() > 0
            # the bound is reached closely (so it is the right one), and it is a quantization's, not MICRO's
            assert 0.5 < (nosync["err"] / (res["one_bound"] + 1e-12)).max() <= 1 + 1e-3
            # relative error of the accumulated gradient (measured 0.48%)
            assert (nosync["got"] - res["exact"]).norm() / res["exact"].norm() < 0.02
        off, on = r[False], r[True]
        assert torch.equal(off["nosync"]["got"], on["nosync"]["got"])  # no residual yet at the one quantization
        assert not torch.equal(off["every"]["got"], on["every"]["got"])  # carried between micro-batches
        every_inputs = [sum(rows) for rows in zip(*on["every_acc"])]  # each source rank's micro-batches
        for mode, inputs in (("nosync", on["every_rank_acc"]), ("every", every_inputs)):
            lhs = world * on[mode]["got"] + sum(on[mode]["residuals"])
            torch.testing.assert_close(lhs, sum(inputs), rtol=1e-5, atol=1e-5, msg=mode)
        # no-sync: the residual is what the one quantization of the accumulated sum lost
        for res_rows, acc in zip(on["nosync"]["residuals"], on["every_rank_acc"]):
            n = acc.shape[1]
            blocked = nn.functional.pad(acc, (0, -(-n // BLOCK) * BLOCK - n)).view(world, -1, BLOCK)
            half = (blocked.abs().amax(2, keepdim=True) / 254).expand_as(blocked).reshape(world, -1)[:, :n]
            assert (res_rows.abs() <= half * (1 + 1e-5) + 1e-7).all()


# ---- checkpoints ---------------------------------------------------------------------------------
_VOCAB = 61  # rows split unevenly over 2 ranks


def _build(policy: fsdp2.QuantizedComm, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Transformer(vocab=_VOCAB, n_layers=2, seed=seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fsdp2.fully_shard(block, mesh=mesh, comm_policy=policy)
    fsdp2.fully_shard(model, mesh=mesh, comm_policy=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    return train_steps(model, opt, steps, vocab=_VOCAB)


def _checkpoint_resume(path: str, feedback: bool, before: int, after: int) -> dict:
    from tests.tools.test_checkpoint import _assert_same, _dcp_load, _dcp_save, _full_state
    policy = fsdp2.QuantizedComm(weights="int8", gradients="int8", error_feedback=feedback)
    model, opt = _build(policy)
    _train(model, opt, range(before))
    _dcp_save(path, model, opt)
    saved = _full_state(model, opt)
    sd_keys = set(model.state_dict())
    residual_norm = sum(p.grad_residual.norm().item() for m in model.modules() if isinstance(m, fsdp2.FSDPModule)
                        for p in get_state(m).group.params if p.grad_residual is not None)
    # What the quantized all-gather hands forward is not what the checkpoint holds.
    fsdp_modules = [m for m in model.modules() if isinstance(m, fsdp2.FSDPModule)]
    for m in fsdp_modules:
        m.unshard()
    gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    for m in fsdp_modules:
        m.reshard()
    straight = _train(model, opt, range(before, before + after))
    final = _full_state(model, opt)

    # The checkpoint on disk, read into a plain (unsharded, unquantized) model: the sharded fp32 values.
    plain = Transformer(vocab=_VOCAB, n_layers=2, seed=2)
    plain_sd = plain.state_dict()
    dcp.load({"model": plain_sd}, checkpoint_id=path)
    on_disk = {k: (v.dtype, torch.equal(v, saved[f"model.{k}"]), torch.equal(v, gathered[k]))
               for k, v in plain_sd.items()}

    model, opt = _build(policy, seed=1)  # other weights: the load must overwrite all of them
    _dcp_load(path, model, opt)
    _assert_same(_full_state(model, opt), saved)
    resumed = _train(model, opt, range(before, before + after))
    end = _full_state(model, opt)
    param_diff = max((end[k] - final[k]).abs().max().item() for k in final if k.startswith("model."))
    opt_dtypes = {str(v.dtype) for k, v in saved.items() if k.startswith("optim.") and not k.endswith(".step")}
    sharded = {type(v).__name__ for v in model.state_dict().values()}
    return {"straight": straight, "resumed": resumed, "on_disk": on_disk, "sd_keys": sd_keys,
            "param_names": {n for n, _ in model.named_parameters()}, "residual_norm": residual_norm,
            "opt_dtypes": opt_dtypes, "sharded": sharded, "param_diff": param_diff,
            "bit_identical_state": all(torch.equal(end[k], final[k]) for k in final)}


def test_checkpoint_holds_unquantized_values_and_resumes_bit_identically(tmp_path):
    """int8 weights and gradients: ``dcp`` saves the sharded fp32 parameters and AdamW state
    (read back into a plain model, every tensor equals the sharded parameter and differs from
    the quantized values forward computed with); a fresh model with the policy, loaded, trains
    on with the uninterrupted run's losses and state, bit for bit."""
    results = run_on_ranks(_checkpoint_resume, 2, str(tmp_path / "ckpt"), False, 2, 3)
    for r in results:
        assert r["resumed"] == r["straight"], (r["resumed"], r["straight"])
        assert r["bit_identical_state"]
        assert r["sd_keys"] == r["param_names"]  # parameters only: no quantization state
        assert r["sharded"] == {"DTensor"} and r["opt_dtypes"] == {"torch.float32"}
        for key, (dtype, equal_saved, equal_gathered) in r["on_disk"].items():
            assert dtype == torch.float32 and equal_saved and not equal_gathered, key
        assert r["residual_norm"] == 0


def test_checkpoint_does_not_hold_error_feedback_residuals(tmp_path):
    """With ``error_feedback=True`` the residuals (each rank's own, per parameter) are not in
    the state dict: a resume starts them at zero, so its first reduction adds no residual
    where the uninterrupted run adds one, and it trains on differently (the losses from the
    second step after the resume on), by little: 3 steps after a resume at step 2 the losses stay within 0.1% of the
    uninterrupted run's (measured <= 0.016%). Parameters: an AdamW step (lr 1e-2) moves an
    element by about ``lr`` whatever its gradient's scale, so a different gradient changes
    it by at most ``2 * lr`` per step (a flipped update, where the update is near zero); the
    largest difference measured after 3 steps is 8.9e-3, under one step's ``lr``; nothing
    else differs (the loaded parameters and AdamW state are the saved ones, bit for bit)."""
    after = 3
    results = run_on_ranks(_checkpoint_resume, 2, str(tmp_path / "ckpt"), True, 2, after)
    for r in results:
        assert r["residual_norm"] > 0  # there was something to lose
        assert not any(".grad_residual" in k or "residual" in k for k in r["sd_keys"])
        assert r["sd_keys"] == r["param_names"]
        for key, (dtype, equal_saved, equal_gathered) in r["on_disk"].items():
            assert dtype == torch.float32 and equal_saved and not equal_gathered, key
        assert r["resumed"][0] == r["straight"][0]  # computed from the same (loaded) parameters
        assert r["resumed"] != r["straight"]  # then: the residuals were not restored
        for a, b in zip(r["straight"], r["resumed"]):
            assert abs(a - b) <= 0.001 * a, (r["straight"], r["resumed"])
        assert 0 < r["param_diff"] <= 2 * after * 1e-2 * 1.01, r["param_diff"]


# ---- messages ------------------------------------------------------------------------------------
def _extension_attached_after_fully_shard(weights: str) -> str:
    """All-gather extension hooks attached to a shard after ``fully_shard`` (which refuses those it
    sees): found at lazy init, where the quantized all-gather refuses them."""
    from tests.runtime.test_all_gather_extension import _bf16_hooks
    model = MLP(8)
    fsdp2.fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
                      comm_policy=fsdp2.QuantizedComm(weights=weights))
    _bf16_hooks(model.in_proj.weight._local_tensor, [])  # the shard object itself (to_local() is a view)
    try:
        model(torch.randn(2, 8))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_extension_found_at_lazy_init_is_refused_naming_the_policy():
    message = run_on_ranks(_extension_attached_after_fully_shard, 2, "int4")[0]
    assert "gathers its own data (fsdp_pre_all_gather), which comm_policy=QuantizedComm(weights='int4') " \
           "cannot quantize" in message, message
