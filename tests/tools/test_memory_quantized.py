"""The memory planner with quantized communication (``Layout.comm_policy``): byte for byte
against ``MemoryTracker`` on real quantized runs, the error-feedback residuals, the wire bytes,
the checks and the command line."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fsdp2 import QuantizedComm
from fsdp2.plan import Layout, estimate_memory
from fsdp2.comm._transport import CPU_COLLECTIVES_ENV, EXCHANGE_MIN_BYTES
from tests._dist import environ, run_on_ranks
from tests.tools.test_memory import _RECIPE, _RECIPE_BATCH, _RECIPE_SEQ, TESTS_TRANSFORMER, _plan, _track_recipe_on


def _planned_and_tracked(transport: str, world: int, case: dict) -> tuple:
    """The tracker's report of a real run of ``case`` on ``world`` gloo ranks under
    ``FSDP2_CPU_COLLECTIVES=transport``, the planner's estimate of it, and their rows compared."""
    from benchmarks.memory import compare, plan
    from recipes.llama.model import ModelArgs

    case = {"reshard_after_forward": True, "activation_checkpointing": True, **case}
    measured = run_on_ranks(_track_recipe_on, world, transport, case)[0]
    with environ(CPU_COLLECTIVES_ENV, transport):
        est = plan(ModelArgs(**_RECIPE), case, world, _RECIPE_BATCH, _RECIPE_SEQ)
    return measured, est, compare(measured, est)


def _assert_byte_for_byte(rows: dict) -> None:
    assert {k: (r["tracker"], r["planner"]) for k, r in rows.items() if r["tracker"] != r["planner"]} == {}
    assert rows["communication"]["tracker"] > 0


_EXCHANGE_CASES = [
    (2, "fsdp", "fp32", {"weights": "int8", "gradients": "int8"}),
    (2, "fsdp", "bf16", {"weights": "int4", "gradients": "int4", "error_feedback": True}),
    (2, "fsdp", "fp32", {"weights": "int4"}),
    (2, "fsdp", "fp32", {"gradients": "int8", "block_size": 64}),
    (4, "hsdp", "fp32", {"weights": "int8", "gradients": "int8", "gradient_axes": "both"}),
]


@pytest.mark.parametrize("world,layout,param_dtype,quantized", [
    *_EXCHANGE_CASES,
    (4, "hsdp", "fp32", {"gradients": "int8", "gradient_axes": "replicate"}),
    (4, "tp", "bf16", {"weights": "int8", "gradients": "int8", "error_feedback": True}),
])
@pytest.mark.slow
def test_planner_matches_tracker_byte_for_byte_with_quantized_comm(world, layout, param_dtype, quantized):
    # The planner runs fsdp2's own quantize and dequantize functions on the meta device where the
    # flat transport (the path NCCL takes) calls them; the tracker watches a real run (gloo, the
    # recipe's model).
    case = {"layout": layout, "param_dtype": param_dtype, "quantized": quantized}
    _assert_byte_for_byte(_planned_and_tracked("flat", world, case)[2])


@pytest.mark.parametrize("world,layout,param_dtype,quantized", _EXCHANGE_CASES)
@pytest.mark.parametrize("transport", ["read", "exchange"])
@pytest.mark.slow
def test_planner_matches_tracker_byte_for_byte_with_quantized_comm_on_the_exchange(transport, world, layout,
                                                                                    param_dtype, quantized):
    # Every group on the CPU exchange: the weights' quantized slices gathered into one rank-major
    # buffer (kept until reshard where peers read it), the gradients' packed rows exchanged
    # (two reduce-scatters in flight), beside the exchange's headers, descriptors and packed chunks.
    case = {"layout": layout, "param_dtype": param_dtype, "quantized": quantized, "cpu_reads": transport == "read"}
    _assert_byte_for_byte(_planned_and_tracked(transport, world, case)[2])


@pytest.mark.slow
def test_planner_matches_tracker_byte_for_byte_with_quantized_comm_on_auto_transports():
    # auto: the root (1,049,088 bytes in fp32, just over EXCHANGE_MIN_BYTES) takes the exchange
    # (reading the peers' memory, one host), the blocks the flat collectives.
    case = {"layout": "fsdp", "param_dtype": "fp32", "quantized": {"weights": "int8", "gradients": "int8"}}
    measured, _, rows = _planned_and_tracked("auto", 2, case)
    root = measured.peak_by_group["root"]
    # On the exchange (and only there) the root's quantized slices stay until it reshards: peers read them.
    assert root["unsharded_params"] >= EXCHANGE_MIN_BYTES and root["communication"] > 0, root
    _assert_byte_for_byte(rows)


@pytest.mark.slow
def test_planner_counts_the_quantized_all_reduce_with_one_shard_rank():
    # HSDP 2 x 1: nothing is gathered or reduce-scattered, the replicas' all-reduce is quantized.
    # Planner and tracker agree to a few bytes: 4 bytes more activations in the real run at the
    # peak (a scalar whose lifetime differs between the fake and the real autograd, not found).
    case = {"layout": "hsdp", "param_dtype": "fp32", "quantized": {"gradients": "int8", "gradient_axes": "both"}}
    measured, _, rows = _planned_and_tracked("flat", 2, case)
    plain = run_on_ranks(_track_recipe_on, 2, "flat", {**case, "reshard_after_forward": True,
                                                        "activation_checkpointing": True, "quantized": {}})[0]
    assert all(abs(r["tracker"] - r["planner"]) <= 8 for r in rows.values()), rows
    assert measured.peak_bytes > plain.peak_bytes + 100_000  # the all-reduce's buffers count


def _padded_fp32_bytes(world: int) -> int:
    """Every trainable parameter's full size, its rows padded to a multiple of ``world``, in fp32."""
    from tests.tools.test_memory import _build_meta_transformer

    total = 0
    for p in _build_meta_transformer().parameters():
        rows = p.shape[0]
        total += -(-rows // world) * world * math.prod(p.shape[1:]) * 4
    return total


def test_error_feedback_residuals_are_counted_for_the_whole_step():
    base = Layout(world=4, batch=1, seq=16, comm_policy=QuantizedComm(gradients="int8"))
    plain = estimate_memory(base, TESTS_TRANSFORMER)
    fed = estimate_memory(replace(base, comm_policy=QuantizedComm(gradients="int8", error_feedback=True)),
                          TESTS_TRANSFORMER)
    residuals = _padded_fp32_bytes(4)
    # Kept from the first reduction on: at the optimizer step exactly them; at the peak them and
    # more (quantizing with error feedback copies the rank-major gradients and their error).
    assert fed.points["optimizer step"] - plain.points["optimizer step"] == residuals
    assert fed.peak_by_category["communication"] - plain.peak_by_category["communication"] > residuals
    # One rank sends nothing and keeps no residual.
    one = Layout(world=1, batch=1, seq=16)
    assert estimate_memory(replace(one, comm_policy=QuantizedComm(gradients="int8", error_feedback=True)),
                           TESTS_TRANSFORMER).peak_bytes == estimate_memory(one, TESTS_TRANSFORMER).peak_bytes


def test_quantized_wire_bytes_per_step():
    # fp32 on the wire unquantized; int8 values and an fp32 scale per 256: about a quarter.
    base = Layout(world=4, batch=1, seq=16)
    plain = estimate_memory(base, TESTS_TRANSFORMER).comm_bytes_per_step
    both = estimate_memory(replace(base, comm_policy=QuantizedComm(weights="int8", gradients="int8")),
                           TESTS_TRANSFORMER).comm_bytes_per_step
    int4 = estimate_memory(replace(base, comm_policy=QuantizedComm(weights="int4", gradients="int4")),
                           TESTS_TRANSFORMER).comm_bytes_per_step
    assert 0.25 < both / plain < 0.27, both / plain
    assert 0.125 < int4 / plain < 0.14, int4 / plain
    # HSDP: the replicas' all-reduce quantized too.
    hsdp = replace(base, dp_replicate=2, comm_policy=QuantizedComm(gradients="int8"))
    axes = estimate_memory(replace(hsdp, comm_policy=QuantizedComm(gradients="int8", gradient_axes="both")),
                           TESTS_TRANSFORMER).comm_bytes_per_step
    assert axes < estimate_memory(hsdp, TESTS_TRANSFORMER).comm_bytes_per_step


def test_layout_checks_the_comm_policy():
    with pytest.raises(TypeError, match="comm_policy must be a fsdp2.QuantizedComm"):
        Layout(world=2, batch=1, seq=16, comm_policy={"weights": "int8"})
    with pytest.raises(ValueError, match="needs dp_replicate > 1"):
        Layout(world=2, batch=1, seq=16, comm_policy=QuantizedComm(gradients="int8", gradient_axes="both"))


def test_plan_cli_quantized_flags():
    plain, fed, refused = (_plan("--config", "llama3_8b", "--world", "64", "--seq", "2048", *flags) for flags in (
        (), ("--quantize-weights", "int8", "--quantize-gradients", "int8", "--error-feedback"), ("--error-feedback",)))
    assert plain.returncode == 0 and fed.returncode == 0, (plain.stderr, fed.stderr)
    comm = [float(line.split()[-2]) for out in (plain.stdout, fed.stdout) for line in out.splitlines()
            if line.startswith("communication per step per rank")]
    # bf16 weights as int8 (a half), fp32 gradients as int8 (a quarter), plus the scales.
    assert 0.3 * comm[0] < comm[1] < 0.45 * comm[0], comm
    needs = [line for out in (plain.stdout, fed.stdout) for line in out.splitlines() if line.startswith("total")]
    assert float(needs[1].split()[1]) > float(needs[0].split()[1]), needs  # the residuals: 4 bytes a parameter
    assert refused.returncode == 2 and "--error-feedback needs --quantize-gradients" in refused.stderr
