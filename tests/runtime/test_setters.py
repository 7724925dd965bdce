"""FSDPModule setters that change numbers or the schedule: divide factor, reshard after forward,
unshard in backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import fsdp2
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.runtime._state import get_state
from tests._dist import environ, run_on_ranks
from tests._models import Transformer, lm_loss, make_batch
from tests._parity import assert_grads_are_average, full, train_parity


def _shard(model: Transformer) -> Transformer:
    for block in model.layers:
        fsdp2.fully_shard(block)
    fsdp2.fully_shard(model)
    return model


def _grads_with_divide_factor(factor: float) -> float:
    """Largest difference between the sharded grads and the reference's sum / factor."""
    rank = dist.get_rank()
    ref = Transformer()
    model = copy.deepcopy(ref)
    _shard(model)
    model.set_gradient_divide_factor(factor)
    inputs, targets = make_batch(rank, 0)
    lm_loss(ref(inputs), targets).backward()
    lm_loss(model(inputs), targets).backward()
    worst = 0.0
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        want = p_ref.grad.clone()
        dist.all_reduce(want)
        want /= factor
        got = full(p.grad)
        assert got.dtype == torch.float32, name
        worst = max(worst, (got - want).abs().max().item() / (want.abs().max().item() + 1e-12))
    return worst


def test_gradient_divide_factor_fp32():
    # Divide the summed gradients by 1 (a plain sum) and by 8, not by the world size.
    for factor in (1.0, 8.0):
        assert max(run_on_ranks(_grads_with_divide_factor, 2, factor)) < 1e-5


def _bf16_grads(factor: float | None) -> list[torch.Tensor]:
    model = Transformer()
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fsdp2.fully_shard(block, mp_policy=policy)
    fsdp2.fully_shard(model, mp_policy=policy)
    if factor is not None:
        model.set_gradient_divide_factor(factor)
    inputs, targets = make_batch(dist.get_rank(), 0)
    lm_loss(model(inputs), targets).backward()
    return [full(p.grad) for p in model.parameters()]


def _divide_factor_rescales_bf16_grads(factor: float) -> float:
    # Same bf16 compute both times; only the division after the fp32 sum differs.
    default, custom = _bf16_grads(None), _bf16_grads(factor)
    world = dist.get_world_size()
    return max(((c * factor - d * world).abs().max() / (d.abs().max() * world + 1e-12)).item()
               for c, d in zip(custom, default))


def test_gradient_divide_factor_bf16_compute_fp32_reduce():
    assert max(run_on_ranks(_divide_factor_rescales_bf16_grads, 2, 3.0)) < 1e-6


def _set_reshard_after_forward_schedule() -> tuple[list[str], list[str]]:
    holder: list[Transformer] = []

    def shard(model: Transformer) -> None:
        _shard(model)
        # Change the policy after fully_shard: blocks keep their parameters for backward,
        # the root frees its own (the opposite of the defaults).
        for block in model.layers:
            block.set_reshard_after_forward(False)
        model.set_reshard_after_forward(True, recurse=False)
        holder.append(model)

    train_parity(Transformer, shard)
    model = holder[0]
    inputs, targets = make_batch(dist.get_rank(), 5)
    with fsdp2.record_schedule() as fwd:
        loss = lm_loss(model(inputs), targets)
    with fsdp2.record_schedule() as bwd:
        loss.backward()
    return list(fwd), list(bwd)


def test_set_reshard_after_forward_changes_schedule_not_numbers():
    for fwd, bwd in run_on_ranks(_set_reshard_after_forward_schedule, 2):
        assert "reshard root" in fwd, fwd
        assert not any(e.startswith("reshard layers.") for e in fwd), fwd
        assert [e for e in bwd if e.startswith("unshard")] == ["unshard root"], bwd


class _Embedded(torch.nn.Module):
    """An embedding (its backward needs only the indices), a layer and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.layer = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.layer(self.emb(tokens))))


def _embedding_not_gathered_in_backward() -> list[str]:
    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _Embedded()
    model = copy.deepcopy(ref)
    for module in (model.emb, model.layer):
        fsdp2.fully_shard(module)
    fsdp2.fully_shard(model)
    model.emb.set_unshard_in_backward(False)
    tokens = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(rank))
    with fsdp2.record_schedule() as events:
        model(tokens).sum().backward()
    ref(tokens).sum().backward()
    assert_grads_are_average(ref, model)
    with pytest.raises(TypeError, match="unshard_in_backward must be a bool, got 'no'"):
        model.emb.set_unshard_in_backward("no")
    return events


def test_set_unshard_in_backward_false_skips_the_gather_not_the_reduction():
    events = run_on_ranks(_embedding_not_gathered_in_backward, 2)
    assert events[0] == events[1]
    assert events[0] == [
        "unshard root", "unshard emb", "reshard emb", "unshard layer", "reshard layer",
        # backward: layer is prefetched by the root; emb is neither prefetched by layer nor gathered
        "unshard layer", "reshard root", "reduce_scatter root", "reshard layer", "reduce_scatter layer",
        "reduce_scatter emb",
    ]


def _reduce_ops(force_sum: bool) -> list[str]:
    """The ops of the flat reduce-scatters of one backward, and the gradients against the reference."""
    from fsdp2 import _compat

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _Embedded()
    model = copy.deepcopy(ref)
    with environ(CPU_COLLECTIVES_ENV, "flat"):
        fsdp2.fully_shard(model.layer)
        fsdp2.fully_shard(model)
    model.layer.set_force_sum_reduction_for_comms(force_sum)  # the layer's group only, as in torch
    ops = []
    original = _compat.reduce_scatter_flat

    def spy(output, send, *, op, **kwargs):  # records the op; the real collective runs
        ops.append(str(op).rsplit(".", 1)[-1])
        return original(output, send, op=op, **kwargs)

    tokens = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(rank))
    _compat.reduce_scatter_flat = spy
    try:
        model(tokens).sum().backward()
    finally:
        _compat.reduce_scatter_flat = original
    ref(tokens).sum().backward()
    assert_grads_are_average(ref, model)
    return ops


def test_set_force_sum_reduction_for_comms_sums_then_divides():
    # Backward reduces the layer first, then the root.
    assert run_on_ranks(_reduce_ops, 2, False) == [["AVG", "AVG"]] * 2
    assert run_on_ranks(_reduce_ops, 2, True) == [["SUM", "AVG"]] * 2


def _deprecated_and_compatibility_setters() -> list[float]:
    model = fsdp2.fully_shard(_Embedded())
    with pytest.warns(DeprecationWarning, match="use set_gradient_divide_factor"):
        model.set_reduce_scatter_divide_factor(4.0)
    model.set_post_optim_event(torch.Event("cpu"))  # accepted; fsdp2 orders the gather after the stream
    with pytest.raises(TypeError, match="set_post_optim_event: event must be a torch.Event or None, got str"):
        model.set_post_optim_event("event")
    with pytest.raises(TypeError, match="enable must be a bool, got 1"):
        model.set_force_sum_reduction_for_comms(1)
    return [get_state(model).group.policy.divide_factor]


def test_deprecated_divide_factor_alias_and_post_optim_event():
    assert run_on_ranks(_deprecated_and_compatibility_setters, 1) == [[4.0]]


def _post_optim_event_from_the_current_stream() -> None:
    """An optimizer step hook hands the root the current stream's event each step, as torch's
    docs suggest. On CPU that event is None (what torch does without one): training matches
    torch's fully_shard and the unsharded reference."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ref = Transformer()
    models = {"fsdp2": copy.deepcopy(ref), "torch": copy.deepcopy(ref)}
    for name, shard in (("fsdp2", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        for block in models[name].layers:
            shard(block)
        shard(models[name])
    events = []

    def hand_over_event(opt, args, kwargs, model) -> None:
        event = torch.get_device_module("cpu").current_stream().record_event()
        events.append(event)
        model.set_post_optim_event(event)

    losses = {}
    for name, model in (*models.items(), ("ref", ref)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if name != "ref":
            opt.register_step_post_hook(lambda o, a, k, model=model: hand_over_event(o, a, k, model))
        losses[name] = []
        for step in range(3):
            inputs, targets = make_batch(dist.get_rank(), step)
            loss = lm_loss(model(inputs), targets)
            loss.backward()
            if name == "ref":
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.detach())
    assert events == [None] * 6
    for name in ("torch", "ref"):
        torch.testing.assert_close(losses["fsdp2"], losses[name], msg=lambda m: f"{name}: {m}")
    for (name, p), ours in zip(ref.named_parameters(), models["fsdp2"].parameters()):
        torch.testing.assert_close(full(ours), p.detach(), msg=lambda m: f"{name}: {m}")


def test_post_optim_event_none_from_a_cpu_stream_trains_as_torch_and_reference():
    run_on_ranks(_post_optim_event_from_the_current_stream, 2)


def _all_reduce_hook_over_replicas(impl: str, transport: str = "auto") -> list[list[int]]:
    """FSDP over pairs of ranks, the hook averaging over the pairs (HSDP by hand): the
    gradients are the average over all four ranks. Returns the hook's (numel,) per call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("hook_rep", "hook_shard"))
    replicas = mesh["hook_rep"].get_group()
    seen = []

    def hook(reduced: torch.Tensor) -> None:
        seen.append([reduced.numel()])
        dist.all_reduce(reduced, group=replicas)  # gloo has no AVG: sum, then divide
        reduced.div_(2)

    torch.manual_seed(0)
    ref = _Embedded()
    model = copy.deepcopy(ref)
    fully_shard = fsdp2.fully_shard if impl == "fsdp2" else torch_fully_shard
    with environ(CPU_COLLECTIVES_ENV, transport):
        fully_shard(model.layer, mesh=mesh["hook_shard"])
        fully_shard(model, mesh=mesh["hook_shard"])
    for module in (model.layer, model):
        module.set_all_reduce_hook(hook)
    tokens = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(rank))
    model(tokens).sum().backward()
    ref(tokens).sum().backward()
    assert_grads_are_average(ref, model)  # over all four ranks
    return seen


@pytest.mark.parametrize("transport", ["flat", "read"])
def test_set_all_reduce_hook_runs_on_the_reduced_shard_like_torch(transport):
    ours = run_on_ranks(_all_reduce_hook_over_replicas, 4, "fsdp2", transport)
    theirs = run_on_ranks(_all_reduce_hook_over_replicas, 4, "torch")
    assert ours == theirs  # the same calls on the same flat shards: the layer, then the root
    # layer: (8 x 8 + 8) / 2 ranks; root: (32 x 8 + 8 x 4 + 4) / 2
    assert ours[0] == [[36], [146]]


def _hook_at_world_size_one() -> list[object]:
    torch.manual_seed(0)
    ref = _Embedded()
    model = fsdp2.fully_shard(copy.deepcopy(ref))
    model.set_all_reduce_hook(lambda reduced: reduced.mul_(2))
    tokens = torch.randint(0, 32, (4, 5))
    model(tokens).sum().backward()
    ref(tokens).sum().backward()
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(full(p.grad), 2 * p_ref.grad)
    with pytest.raises(TypeError, match="set_all_reduce_hook: hook must be callable, got int"):
        model.set_all_reduce_hook(3)
    with pytest.raises(ValueError, match="set_all_reduce_hook: stream is for CUDA meshes; leave it None"):
        model.set_all_reduce_hook(print, stream=object())
    return ["ok"]


def test_all_reduce_hook_at_world_size_one_and_bad_arguments():
    assert run_on_ranks(_hook_at_world_size_one, 1) == [["ok"]]
