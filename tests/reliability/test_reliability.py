"""Surviving faults: ranks that disagree, ranks out of step, hangs, exceptions, NaN gradients.

* Ranks that built different models fail at the first forward, on every rank, naming the
  first difference.
* Ranks whose all-gathers pair up although they gather different groups (one rank skipped a
  forward) fail on every rank instead of computing with the wrong parameters.
* A collective that times out names the group, the collective, the iteration and the phase.
* ``FSDP2_DEBUG`` / ``set_debug`` log every collective.
* An exception in forward or backward is recovered from at the next forward, by itself.
* ``set_check_finite_gradients`` raises ``FloatingPointError`` on every rank, naming the parameter.

Tests that leave a collective unmatched on purpose run on a fresh process group, so the pool's
world group stays usable, and wait only briefly for the peer that left it.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from fsdp2 import QuantizedComm, fully_shard, register_fsdp_forward_method
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV
from fsdp2.diagnostics._debug import set_debug
from fsdp2._common import ShardState
from fsdp2.runtime._state import get_state
from tests._dist import REPO_ROOT, environ, run_on_ranks
from tests._models import MLP, Block, Transformer, lm_loss, make_batch
from tests._parity import assert_params_match, average_grads
from tests._together import launched_together
from tests.runtime.test_module_behaviour import InjectedFailure, _RaiseInBackward

DIM, HEADS = 32, 4
SOON_S = 0.5  # how long a rank waits for a peer that has left (_stop_waiting_soon)


# ---- helpers (run inside ranks) ---------------------------------------------------------
@contextlib.contextmanager
def _fresh_mesh(timeout_s: float) -> Iterator[DeviceMesh]:
    """A 1-D mesh on a new process group: a collective left unmatched here spoils only it.

    It has an axis name of its own: DeviceMesh equality ignores the process group, so an
    unnamed mesh on the world's ranks would equal the default mesh of later tests, and
    DTensor's caches could hand them this (spoilt) group. Destroyed afterwards.
    """
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield DeviceMesh.from_group(group, "cpu", mesh_dim_names=(f"fresh_{group.group_name}",))
    finally:
        dist.destroy_process_group(group)


def _stop_waiting_soon(mesh: DeviceMesh) -> None:
    """This rank's next collectives on ``mesh`` time out after ``SOON_S``, not the group's timeout.

    For a rank whose peer has left ``mesh`` for good: the collective it enters next cannot
    complete, however long it waits, so the wait proves nothing. The collectives both ranks
    ran before had the group's longer timeout, so a peer slow there (a loaded machine) is no
    timeout. Collectives only: gloo's point-to-point receives keep the timeout the group was
    made with.
    """
    mesh.get_group().set_timeout(datetime.timedelta(seconds=SOON_S))


def _shard(model: nn.Module, **kwargs) -> nn.Module:
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _assert_clean(model: nn.Module) -> None:
    """No unsharded parameter left behind: every group SHARDED, every parameter a DTensor."""
    for module in model.modules():
        state = get_state(module)
        if state is not None and state.group is not None:
            assert state.group.state is ShardState.SHARDED, f"{state.group.label} is {state.group.state}"
    assert all(isinstance(p, DTensor) for p in model.parameters())


class _Capture(logging.Handler):
    """Keeps the messages of the ``fsdp2`` logger's records."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Capture:
        logging.getLogger("fsdp2").addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger("fsdp2").removeHandler(self)


# ---- 1. ranks agree on the model at lazy init ----------------------------------------------
def _two_mlps(variant: str, odd: bool) -> nn.Sequential:
    """The model every rank builds, with one difference on the ``odd`` rank(s)."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(8, hidden=16 if odd and variant == "shape" else 32), MLP(8))
    if odd and variant == "requires_grad":
        model[1].out_proj.bias.requires_grad_(False)
    if odd and variant == "meta":  # never materialized there: every rank raises, none waits in a collective
        with torch.device("meta"):
            model[1] = MLP(8)
    return model


def _disagree(variant: str, mesh_shape: tuple[int, ...], odd_rank: int) -> str:
    odd = dist.get_rank() == odd_rank
    names = ("dp_replicate", "dp_shard") if len(mesh_shape) == 2 else None
    if odd and variant == "mesh":  # the same ranks, but a mesh built for another purpose
        names = ("tp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = _two_mlps(variant, odd)
    fully_shard(model[0], mesh=mesh, reshard_after_forward=not (odd and variant == "reshard_after_forward"))
    if not (odd and variant == "groups"):
        fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match="fsdp2: ranks disagree on the sharded model") as info:
        model(torch.randn(2, 8))
    return str(info.value)


@pytest.mark.parametrize("variant, expected", [
    ("shape", r"rank 0 has 0.in_proj.weight \(32, 8\) float32, rank 1 has 0.in_proj.weight \(16, 8\) float32"),
    ("requires_grad", r"rank 0 has 1.out_proj.bias \(8,\) float32, rank 1 has 1.out_proj.bias \(8,\) float32 "
                      r"requires_grad=False"),
    ("reshard_after_forward", r"rank 0 has group 0 \(reshard_after_forward=True, .*\), "
                              r"rank 1 has group 0 \(reshard_after_forward=False, "),
    ("groups", r"rank 0 has fully_shard groups \[0, 1\], rank 1 has fully_shard groups \[root, 0\]"),
    ("mesh", r"rank 0 has group 0 \(reshard_after_forward=True, mesh \(axis0=2\) on cpu, ranks \[0, 1\]\), "
             r"rank 1 has group 0 \(reshard_after_forward=True, mesh \(tp=2\) on cpu, ranks \[0, 1\]\)"),
    ("meta", r"rank 0 has 1.in_proj.weight \(32, 8\) float32, rank 1 has 1.in_proj.weight \(32, 8\) float32 "
             r"on the meta device"),
], ids=["shape", "requires_grad", "reshard_after_forward", "groups", "mesh", "meta"])
def test_ranks_that_built_different_models_fail_at_first_forward(variant, expected):
    messages = run_on_ranks(_disagree, 2, variant, (2,), 1)
    assert messages[0] == messages[1]
    assert re.search(expected, messages[0]), messages[0]


def test_disagreement_on_one_rank_of_a_2d_mesh_reaches_every_rank():
    # HSDP on (2 replicas, 2 shards): rank 3 differs; ranks 0 and 1 share no group with it
    # on the shard axis, and rank 0 shares none at all: the verdict travels both axes.
    messages = run_on_ranks(_disagree, 4, "shape", (2, 2), 3)
    assert len(set(messages)) == 1
    # Found along the replicate axis (ranks 1 and 3) and the shard axis (ranks 2 and 3).
    assert "rank 1 has 0.in_proj.weight (32, 8) float32, rank 3 has 0.in_proj.weight (16, 8) float32" \
        in messages[0]


# ---- 2. all-gathers that pair up across different groups ----------------------------------
def _skipped_forward() -> str:
    """Gradient accumulation over two micro-batches; rank 1 skips one micro-batch's forward."""
    rank = dist.get_rank()
    with _fresh_mesh(20) as mesh:
        model = _shard(Transformer(n_layers=3), mesh=mesh)
        with pytest.raises(RuntimeError, match="all-gathers of different groups matched up") as info:
            for step in range(3):
                losses = []
                for micro in range(2):
                    if rank == 1 and step == 1 and micro == 0:
                        continue
                    x, y = make_batch(rank, 2 * step + micro)
                    losses.append(lm_loss(model(x), y))
                sum(losses).backward()
    return str(info.value)


def test_rank_that_skipped_a_forward_fails_on_every_rank():
    # Rank 0 runs its 4th forward (step 4) and prefetches layers.0, while rank 1, one
    # forward short, starts backward of step 3 by prefetching layers.2; the blocks are
    # the same size, so the two all-gathers pair up.
    messages = run_on_ranks(_skipped_forward, 2)
    assert messages[0] == messages[1]
    assert ("rank 1 is gathering layers.2 in backward of step 3 while rank 0 is gathering "
            "layers.0 in forward of step 4: ranks ran different forward/backward sequences") in messages[0]


def _aligned_schedules(layout: str) -> int:
    """Paths whose headers must agree: PARTIAL re-gathers, HSDP, one rank, explicit unshard."""
    world = dist.get_world_size()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    elif layout == "one_rank":
        mesh = DeviceMesh.from_group(dist.new_group([dist.get_rank()]), "cpu")
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs = {"reshard_after_forward": 2} if layout == "partial" else {}
    model = _shard(Transformer(n_layers=2), mesh=mesh, **kwargs)
    for step in range(2):
        model.layers[0].unshard()  # explicit, outside forward
        x, y = make_batch(dist.get_rank(), step)
        lm_loss(model(x), y).backward()
    _assert_clean(model)
    return step


@pytest.mark.parametrize("world", [4, 64])  # one comparison of the rows, then row by row for the message
def test_the_header_check_finds_the_odd_rank_at_any_world_size(world):
    from types import SimpleNamespace

    from fsdp2._compat import fake_process_group
    from fsdp2.runtime import _checks

    magic, odd = 0x46534432, world - 2
    group = SimpleNamespace(root=None)  # no root yet: groups are named by their index

    def check(odd_row: list[int]) -> None:
        rows = [[magic, 5, 3, 0] for _ in range(world)]
        rows[odd] = odd_row
        _checks._check_all_gather_headers(group, torch.tensor(rows, dtype=torch.int32).view(torch.uint8),
                                          dist.group.WORLD)

    with fake_process_group(world):
        with pytest.raises(RuntimeError, match=rf"rank {odd} is gathering group #4 in forward of step 6 "
                                               r"while rank 0 is gathering group #3 in forward"):
            check([magic, 5, 4, 0])  # another group
        with pytest.raises(RuntimeError, match=rf"rank {odd} is gathering group #3 in backward"):
            check([magic, 5, 3, 1])  # the same group in backward
        check([magic, 7, 3, 2])  # an explicit unshard pairs with forward, in any iteration
        check([0, 0, 4, 1])  # stale bytes (no header this time): not compared


@pytest.mark.parametrize("world,stride", [(4, 16), (64, 48), (256, 592), (8, 20)])
def test_the_in_place_key_comparison_finds_the_odd_rank(world, stride):
    # On CPU each rank's key is read where the all-gather put it (HeaderSlot.keys_agree): rows
    # ``stride`` bytes apart, as in a flat all-gather's output; rows not 8-byte strided take
    # the slower look, which must reach the same verdict.
    import struct
    from types import SimpleNamespace

    from fsdp2._compat import fake_process_group
    from fsdp2.runtime import _checks

    magic, odd = 0x46534432, world // 2 + 1
    slot = _checks.HeaderSlot()
    struct.pack_into("=4i", slot.raw, 0, magic, 5, 3, 0)
    slot.current = True
    group = SimpleNamespace(root=None, header_slot=slot)
    output = torch.zeros(world * stride + 4, dtype=torch.uint8)
    headers = output.as_strided((world, 16), (stride, 1), 4 if stride % 8 else 0)
    headers.copy_(slot.tensor.expand(world, 16))
    # Another iteration on rank 1: only the key must agree.
    headers[1, 4:8] = torch.tensor([6], dtype=torch.int32).view(torch.uint8)
    assert slot.keys_agree(headers) is (stride % 8 == 0)
    with fake_process_group(world):
        _checks._check_all_gather_headers(group, headers, dist.group.WORLD)
        headers[odd, 8:12] = torch.tensor([4], dtype=torch.int32).view(torch.uint8)
        assert not slot.keys_agree(headers)
        with pytest.raises(RuntimeError, match=rf"rank {odd} is gathering group #4 in forward of step 6 "
                                               r"while rank 0 is gathering group #3 in forward"):
            _checks._check_all_gather_headers(group, headers, dist.group.WORLD)


@pytest.mark.parametrize("layout", ["partial", "hsdp", "one_rank"])
def test_headers_agree_on_every_all_gather_path(layout):
    assert run_on_ranks(_aligned_schedules, 4, layout) == [1] * 4


class _Routed(nn.Module):
    """Two layers; the second runs only where ``use_b`` (a branch that differs between ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return self.b(y) if use_b else y


def _gradients_on_some_ranks_only(transport: str) -> str:
    with environ(CPU_COLLECTIVES_ENV, transport), _fresh_mesh(20) as mesh:
        torch.manual_seed(0)
        model = fully_shard(_Routed(), mesh=mesh)
        with pytest.raises(RuntimeError) as info:
            model(torch.randn(2, 8), dist.get_rank() == 0).sum().backward()
        return str(info.value)


@pytest.mark.parametrize("transport", ["exchange", "read"])
def test_ranks_disagreeing_on_which_parameters_get_gradients_fail_on_every_rank(transport):
    # The exchange sends which gradients each rank reduces ahead of them: rank 1 never
    # touched b, so it reduces a's two gradients where rank 0 reduces four.
    messages = run_on_ranks(_gradients_on_some_ranks_only, 2, transport)
    assert messages[0] == messages[1]
    assert messages[0].startswith("fsdp2: ranks disagree on which parameters of root received gradients: "
                                  "rank 1 reduces 2 of them, rank 0 reduces 4. A branch that runs on some "
                                  "ranks only"), messages[0]
    # (gloo's flat reduce-scatter, which groups under 1 MiB use, aborts the process instead.)


# ---- 3. hang diagnostics and debug logging ----------------------------------------------
def _peer_raises_before_forward() -> str:
    rank = dist.get_rank()
    with _fresh_mesh(20) as mesh:
        model = _shard(Transformer(n_layers=2), mesh=mesh)
        x, y = make_batch(rank, 0)
        lm_loss(model(x), y).backward()  # step 1 runs on both ranks
        _stop_waiting_soon(mesh)  # rank 1 runs no collective of this group again
        if rank == 1:
            with pytest.raises(InjectedFailure, match="bad batch"):
                raise InjectedFailure("bad batch")  # the user's own error: fsdp2 is not involved
            dist.barrier()  # (the default group's) the fresh group stays until rank 0 timed out
            return "InjectedFailure: bad batch"
        # gloo words a timeout in two ways, depending on where the pair was when it expired.
        timed_out = "Timed out|Application timeout caused pair closure"
        with pytest.raises(RuntimeError, match=timed_out) as info:
            model(x)  # step 2: the root's all-gather waits for rank 1 until the timeout
        dist.barrier()
        assert info.value.__cause__ is not None and re.search(timed_out, str(info.value.__cause__))
        return str(info.value)


def test_timeout_names_group_collective_iteration_and_phase():
    messages = run_on_ranks(_peer_raises_before_forward, 2)
    assert messages[1] == "InjectedFailure: bad batch"
    assert messages[0].startswith("fsdp2: all_gather of root (2 ranks x ")
    assert "failed on rank 0 during forward of step 2: " in messages[0]


def _peer_skips_quantized_backward(transport: str) -> str:
    rank = dist.get_rank()
    # The exchange reduces by point-to-point messages, which wait the group's whole timeout.
    with environ(CPU_COLLECTIVES_ENV, transport), _fresh_mesh(3 if transport == "exchange" else 20) as mesh:
        # kept gathered: the first collective of the backward is the block's reduction
        model = _shard(Transformer(n_layers=1), mesh=mesh, reshard_after_forward=False,
                       comm_policy=QuantizedComm(gradients="int8"))
        x, y = make_batch(rank, 0)
        loss = lm_loss(model(x), y)
        _stop_waiting_soon(mesh)  # rank 1 runs no collective of this group again
        if rank == 1:
            dist.barrier()  # (the default group's) no backward here: rank 0's reduction waits alone
            return ""
        with pytest.raises(RuntimeError) as info:
            loss.backward()
        dist.barrier()
        return str(info.value)


@pytest.mark.parametrize("transport", ["flat", "exchange"])
def test_timeout_of_a_quantized_reduction_names_it(transport, python_runs):
    # (python_runs: its interpreter starts while rank 0 here waits out the exchange's timeout)
    message = run_on_ranks(_peer_skips_quantized_backward, 2, transport)[0]
    assert message.startswith("fsdp2: reduce_scatter of "), message
    assert re.search(r"\(2 x \d+ elements \(int8 all-to-all\)\) failed on rank 0 during backward", message), message


def _debug_log() -> tuple[list[str], list[str]]:
    model = _shard(Transformer(n_layers=1), mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    x, y = make_batch(dist.get_rank(), 0)
    with _Capture() as on:
        set_debug(True)
        try:
            lm_loss(model(x), y).backward()
        finally:
            set_debug(False)
    with _Capture() as off:
        lm_loss(model(x), y).backward()
    return on.messages, off.messages


def test_debug_mode_logs_every_collective():
    for on, off in run_on_ranks(_debug_log, 2):
        assert off == []
        gathers = [m for m in on if " all_gather " in m]
        scatters = [m for m in on if " reduce_scatter " in m]
        # root and layers.0 gathered in forward, layers.0 again in backward; both reduced.
        assert len(gathers) == 3 and len(scatters) == 2, on
        block_bytes = sum(p.numel() * 4 for p in Block(DIM, HEADS).parameters())
        sizes = [int(m) for m in re.findall(
            r"rank \d: all_gather layers\.0 over 2 ranks: (\d+) bytes per rank uint8, during forward of "
            r"step 1", "\n".join(gathers))]
        assert len(sizes) == 1 and block_bytes // 2 < sizes[0] < block_bytes // 2 + 1024, gathers
        assert any(re.fullmatch(r"rank \d: reduce_scatter layers\.0 over 2 ranks: 2 x \d+ elements float32, "
                                r"during backward of step 1", m) for m in scatters), scatters


def _import_with_debug_on(tmp: Path) -> subprocess.CompletedProcess:
    code = ("import logging, fsdp2, fsdp2.diagnostics._debug as d; "
            "assert d.enabled() and logging.getLogger('fsdp2').getEffectiveLevel() == logging.DEBUG; "
            "assert logging.getLogger('fsdp2').handlers; d.set_debug(False); "
            "assert not d.enabled() and not logging.getLogger('fsdp2').handlers")
    env = {**os.environ, "FSDP2_DEBUG": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


# The fresh interpreter of the test named below, started (tests/_together.py) by the first test
# that asks: test -> the future of (its directory, the finished process).
python_runs = launched_together({
    "test_fsdp2_debug_environment_variable_turns_debug_on_at_import": _import_with_debug_on,
})


@pytest.mark.slow
def test_fsdp2_debug_environment_variable_turns_debug_on_at_import(python_runs, request):
    _, out = python_runs[request.node.originalname].result()
    assert out.returncode == 0, out.stderr


# ---- 4. automatic recovery after an exception ------------------------------------------
class _NanGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class FaultyBlock(Block):
    """Fails in forward or backward, or poisons its input gradient, on demand."""

    fault: str | None = None

    def forward(self, x):
        y = super().forward(x)
        if self.fault == "forward":
            raise InjectedFailure("injected failure in forward")
        if self.fault == "backward":
            y = _RaiseInBackward.apply(y)
        if self.fault == "nan":
            y = _NanGrad.apply(y)
        return y


def _faulty_transformer() -> Transformer:
    model = Transformer(n_layers=3)
    faulty = FaultyBlock(DIM, HEADS)
    faulty.load_state_dict(model.layers[1].state_dict())
    model.layers[1] = faulty
    return model


def _step(model: nn.Module, step: int) -> torch.Tensor:
    x, y = make_batch(dist.get_rank(), step)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.detach()


def _train_with_fault(fault: str, explicit_reset: bool, bad_step: int = 1, steps: int = 4) -> list[str]:
    """Train a sharded model and a reference; ``fault`` hits every rank at ``bad_step``.

    The reference skips that batch. Returns the warnings fsdp2 logged.
    """
    ref = _faulty_transformer()
    model = _shard(copy.deepcopy(ref))
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = FloatingPointError if fault == "nan" else InjectedFailure
    with _Capture() as log:
        for step in range(steps):
            if step == bad_step:
                model.layers[1].fault = fault
                with pytest.raises(expected):
                    _step(model, step)
                model.layers[1].fault = None
                if explicit_reset:
                    model.reset_iter_state()
                opt.zero_grad()
                continue
            ref_loss = _step(ref, step)
            average_grads(ref)
            ref_opt.step()
            ref_opt.zero_grad()
            loss = _step(model, step)
            opt.step()
            opt.zero_grad()
            torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert_params_match(ref, model)
    _assert_clean(model)
    return [m for m in log.messages if "interrupted" in m]


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("explicit_reset", [False, True], ids=["automatic", "reset_iter_state"])
def test_training_goes_on_after_an_exception(where, explicit_reset):
    for warnings in run_on_ranks(_train_with_fault, 2, where, explicit_reset):
        if explicit_reset:
            assert warnings == []
        else:
            assert len(warnings) == 1
            assert f"step 2 of FSDPTransformer was interrupted by an exception in {where}" in warnings[0]


def _train_with_fault_reading(where: str) -> list[str]:
    with environ(CPU_COLLECTIVES_ENV, "read"):  # collectives in flight read the peers' buffers
        return _train_with_fault(where, False)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_training_goes_on_after_an_exception_while_ranks_read_each_other(where):
    # A gather prefetched when the exception hit is finished by the reset: its buffer must stay
    # until the peer has read it, or the ranks' next exchanges would not match up.
    for warnings in run_on_ranks(_train_with_fault_reading, 2, where):
        assert len(warnings) == 1 and f"interrupted by an exception in {where}" in warnings[0]


class _Embedder(Transformer):
    def embed(self, tokens: torch.Tensor, fail: bool) -> torch.Tensor:
        x = self.tok_emb(tokens)
        if fail:
            raise InjectedFailure("injected failure in embed")
        return x


def _registered_method_raises() -> list[str]:
    """An extra forward method (register_fsdp_forward_method) that raises is recovered from too."""
    model = _shard(_Embedder(n_layers=2))
    register_fsdp_forward_method(model, "embed")
    x, _ = make_batch(dist.get_rank(), 0)
    with _Capture() as log:
        model.embed(x, fail=False)
        with pytest.raises(InjectedFailure):
            model.embed(x, fail=True)
        _step(model, 0)
    _assert_clean(model)
    return [m for m in log.messages if "interrupted" in m]


def test_exception_in_registered_forward_method_is_recovered_from():
    for warnings in run_on_ranks(_registered_method_raises, 2):
        assert len(warnings) == 1 and "interrupted by an exception in forward" in warnings[0]


def _legitimate_patterns() -> list[str]:
    """Two forwards before one backward, and forwards re-run inside backward: no reset."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Transformer(n_layers=2)
    for i, layer in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(layer)
    model = _shard(model)
    rank = dist.get_rank()
    with _Capture() as log:
        for step in range(2):
            losses = [lm_loss(model(x), y) for x, y in (make_batch(rank, 2 * step + m) for m in range(2))]
            sum(losses).backward()
    _assert_clean(model)
    return [m for m in log.messages if "interrupted" in m]


def test_gradient_accumulation_and_recomputation_are_not_mistaken_for_interruptions():
    assert run_on_ranks(_legitimate_patterns, 2) == [[], []]


# ---- 5. finite-gradient guard ------------------------------------------------------------
def _nan_on_one_rank() -> str:
    """Rank 1's gradient through layers.1 is NaN at step 1; every rank raises; training goes on."""
    rank = dist.get_rank()
    ref = _faulty_transformer()
    model = _shard(copy.deepcopy(ref))
    model.set_check_finite_gradients(True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    message = ""
    with _Capture() as log:
        for step in range(3):
            if step == 1:
                model.layers[1].fault = "nan" if rank == 1 else None
                with pytest.raises(FloatingPointError) as info:
                    _step(model, step)
                message = str(info.value)
                model.layers[1].fault = None
                opt.zero_grad()
                continue
            _step(ref, step)
            average_grads(ref)
            ref_opt.step()
            ref_opt.zero_grad()
            _step(model, step)
            opt.step()
            opt.zero_grad()
    assert_params_match(ref, model)
    _assert_clean(model)
    assert not [m for m in log.messages if "interrupted" in m]  # a clean end of backward
    return message


def test_non_finite_gradient_raises_on_every_rank_naming_the_parameter():
    messages = run_on_ranks(_nan_on_one_rank, 2)
    assert messages[0] == messages[1]
    # Backward reduces layers.2 first (finite), then layers.1: its first parameter is the
    # first non-finite one. NaN on rank 1 reaches every element of the summed gradient, so
    # each rank's half of the (32,) norm weight is all NaN.
    assert messages[0].startswith(
        "fsdp2: non-finite gradient in step 2: layers.1.attn_norm.weight has non-finite elements "
        "(16 on rank 0, 16 on rank 1)")


def _guard_off_by_default() -> bool:
    model = _shard(_faulty_transformer())
    model.layers[1].fault = "nan"
    _step(model, 0)  # no error: the guard is opt-in
    return bool(torch.isnan(model.layers[0].mlp.in_proj.weight.grad.to_local()).all())


def test_finite_guard_is_off_by_default():
    assert run_on_ranks(_guard_off_by_default, 2) == [True, True]


# ---- 5. a mesh equal to an earlier one keeps its own process groups -------------------------
def _groups(t: torch.Tensor) -> list[dist.ProcessGroup]:
    mesh = t.device_mesh
    return [mesh.get_group(i) for i in range(mesh.ndim)]


def _equal_meshes() -> list[int]:
    """A model on a fresh 2-D mesh equal (by value) to one an earlier model used.

    DTensor's op cache compares meshes by value, so ``nn.Parameter(dtensor)`` and
    ``dtensor.detach()`` can come back on the earlier mesh, whose groups are others: the
    parameters, their gradients and the state dict must still name the new mesh's groups.
    """
    shape, names = (2, 2), ("dp_replicate", "dp_shard")
    earlier = MLP(8, hidden=16)
    fully_shard(earlier, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    earlier(torch.randn(2, 8)).sum().backward()  # runs DTensor ops on its parameters too
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    expected = [mesh.get_group(i) for i in range(mesh.ndim)]
    model = MLP(8, hidden=16)  # the same shapes: every cached op matches
    fully_shard(model, mesh=mesh)
    for step in range(2):
        model(torch.randn(2, 8)).sum().backward()
        for name, p in model.named_parameters():
            assert _groups(p) == expected, f"step {step}: {name} is on another mesh"
            assert _groups(p.grad) == expected, f"step {step}: {name}.grad is on another mesh"
        for key, value in model.state_dict().items():
            assert _groups(value) == expected, f"step {step}: state_dict[{key!r}] is on another mesh"
        model.zero_grad()
    with torch.no_grad():  # and collectives on them pair up across ranks
        return [round(p.full_tensor().sum().item(), 4) for p in model.parameters()]


def test_a_mesh_equal_to_an_earlier_one_keeps_its_own_groups():
    results = run_on_ranks(_equal_meshes, 4)
    assert all(r == results[0] for r in results), results
