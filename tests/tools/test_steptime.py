"""The step-time model (issue #39 item 1): its parts against hand-computed cases, its errors, its CLI.

- ``model_costs`` counts a Linear's 2 m n k FLOPs, as many as ``FlopCounterMode`` counts for the
  recipe's Llama, and the 8B preset's step within 2% of 6 N tokens + attention by formula.
- ``predict_step_time``: a ring all-gather's time on a hand profile, the link an axis crosses,
  HSDP's all-reduce twice a ring pass, 1F1B's bubble (pp - 1) / (m + pp - 1) of the step,
  activation checkpointing's one more forward, and what more ranks must (not) change.
- ``Hardware`` refuses nonsense; ``calibrate`` measures positive, finite figures (on a rank pool,
  and from the CLI's ``--calibrate``); ``--hardware h100`` prints tokens/s and MFU.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from fsdp2.plan import (HARDWARE, Hardware, Layout, ModelBuilder, StepTime, calibrate, load_hardware, model_costs,
                       predict_step_time, ring_time)
from fsdp2.plan._steptime import _compute, _fsdp, _Links
from fsdp2.models.llama import LLAMA3, ModelArgs, Transformer
from fsdp2.plan import main
from tests._dist import run_on_ranks

GiB = 2**30
# A hand profile: round figures, nothing "reached" below what is stated.
HAND = Hardware(name="hand", peak_flops=100e12, hbm_bandwidth=1e12, devices_per_node=8, intra_bandwidth=100e9,
                intra_latency=1e-6, inter_bandwidth=10e9, inter_latency=1e-5, memory=80 * GiB,
                flops_efficiency=1.0, bandwidth_efficiency=1.0, link_efficiency=1.0)
# Links that cost nothing: what is left is compute, bubbles and the optimizer.
FREE_LINKS = dataclasses.replace(HAND, intra_bandwidth=1e30, inter_bandwidth=1e30, intra_latency=0.0,
                                 inter_latency=0.0)
SMALL = ModelArgs(dim=256, n_layers=8, n_heads=4, n_kv_heads=2, vocab_size=1024, max_seq_len=512)


class _Linears(nn.Module):
    """A root Linear (so the blocks' inputs need gradients) and blocks of one bias-free Linear each."""

    def __init__(self, k: int = 64, n: int = 96) -> None:
        super().__init__()
        self.embed = nn.Linear(k, k, bias=False)
        self.layers = nn.ModuleList([nn.Linear(k, n, bias=False), nn.Linear(n, n, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _linears() -> ModelBuilder:
    return ModelBuilder(build=_Linears, num_blocks=2, loss_fn=lambda out, _inputs: out.sum(),
                        make_inputs=lambda batch, seq: torch.zeros(batch, seq, 64))


def test_a_linear_counts_2mnk_forward_and_twice_that_backward():
    builder = _linears()
    costs = model_costs(Layout(world=1, batch=1, seq=32), builder)
    m, k, n = 32, 64, 96  # block 0: (1, 32, 64) @ (64, 96)
    assert costs.flops("block_forward") == 2 * m * n * k
    assert costs.flops("block_backward") == 2 * (2 * m * n * k)  # the input's gradient and the weight's
    assert costs.block_params == k * n and costs.rest_params == k * k  # the root: embed
    assert costs.boundary_bytes == m * n * 4


def test_llama_flops_are_what_flop_counter_mode_counts():
    # FlopCounterMode on the same model: attention by the meta device's math kernel (unmasked,
    # backward 2x forward), which is the convention model_flops keeps.
    builder = ModelBuilder.llama(dataclasses.replace(SMALL, n_layers=2))
    seq = 128
    costs = model_costs(Layout(world=1, batch=1, seq=seq), builder)
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(SMALL, n_layers=2))
        tokens = torch.zeros(1, seq, dtype=torch.long)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        builder.loss_fn(model(tokens), tokens).backward()
    assert costs.model_flops == counter.get_total_flops()


def test_8b_flops_match_6_n_tokens_plus_attention():
    args, seq = LLAMA3["llama3_8b"], 8192
    costs = model_costs(Layout(world=8, batch=1, seq=seq, param_dtype=torch.bfloat16), ModelBuilder.llama(args))
    n = costs.params - args.vocab_size * args.dim  # the embedding's lookup multiplies nothing
    formula = 6 * n * seq + 12 * args.n_layers * args.dim * seq * seq  # attention: QK^T and AV, x3 for backward
    assert costs.model_flops == pytest.approx(formula, rel=0.02)
    assert 8.0e9 < costs.params < 8.1e9


def test_ring_all_gather_time_by_hand_and_the_link_it_crosses():
    # 1 GB over 8 ranks in a node: 7/8 of it at 100 GB/s, plus 7 steps of 1 us.
    assert ring_time(1e9, 8, 100e9, 1e-6) == pytest.approx(7 / 8 * 1e9 / 100e9 + 7e-6)
    assert ring_time(1e9, 1, 100e9, 1e-6) == 0
    inside = _Links(Layout(world=8, batch=1, seq=8), HAND)
    assert inside.link("dp_shard") == (100e9, 1e-6) and inside.ring("dp_shard", 1e9) == ring_time(1e9, 8, 100e9, 1e-6)
    across = _Links(Layout(world=16, batch=1, seq=8), HAND)  # 16 ranks: two nodes
    assert across.link("dp_shard") == (10e9, 1e-5)
    # tp innermost: 8 TP ranks fill a node, the shard axis (stride 8) crosses nodes.
    tp = _Links(Layout(world=16, batch=1, seq=8, tp=8), HAND)
    assert not tp.crosses("tp") and tp.crosses("dp_shard")
    hsdp = _Links(Layout(world=16, batch=1, seq=8, dp_replicate=2), HAND)
    assert not hsdp.crosses("dp_shard") and hsdp.crosses("dp_replicate")


def test_hsdp_all_reduce_is_twice_a_ring_pass_of_the_shard():
    layout = Layout(world=16, batch=1, seq=32, dp_replicate=2)
    costs = model_costs(layout, _linears())
    block, _root = _fsdp(layout, costs, _Links(layout, HAND))
    shard_bytes = costs.block_params * 4 / 8  # fp32 gradients, over 8 shard ranks
    assert block.all_reduce == pytest.approx(2 * ring_time(shard_bytes, 2, 10e9, 1e-5))  # replicas across nodes
    assert block.gather == pytest.approx(ring_time(costs.block_params * 4, 8, 100e9, 1e-6))


def test_1f1b_bubble_is_pp_minus_1_over_m_plus_pp_minus_1():
    builder = ModelBuilder.llama(SMALL)
    layout = Layout(world=4, batch=8, seq=128, pp=4, pp_microbatches=8, reshard_after_forward=False)
    step = predict_step_time(layout, model_costs(layout, builder), FREE_LINKS)
    assert step.bubble / (step.compute + step.bubble) == pytest.approx(3 / 11)
    interleaved = dataclasses.replace(layout, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2)
    assert predict_step_time(interleaved, model_costs(interleaved, builder), FREE_LINKS).bubble == \
        pytest.approx(step.bubble / 2)
    zero = dataclasses.replace(interleaved, pp_schedule="InterleavedZeroBubble")
    assert predict_step_time(zero, model_costs(zero, builder), FREE_LINKS).bubble < step.bubble / 2
    # Ranks sharing cores: the busy ones use the idle ones' cores. busy = 8 / 3 x the bubble here;
    # 1.25 ranks per core run the 11 slots' schedule in 11 / 1.25 = 8.8 of the 8 busy slots' time.
    shared = dataclasses.replace(FREE_LINKS, oversubscription=1.25)
    busy = step.bubble * 8 / 3
    assert predict_step_time(layout, model_costs(layout, builder), shared).bubble == \
        pytest.approx((busy + step.bubble) / 1.25 - busy)
    # Two ranks a core: the bubble is all absorbed, the step is the ranks' own work.
    assert predict_step_time(layout, model_costs(layout, builder),
                             dataclasses.replace(FREE_LINKS, oversubscription=2.0)).bubble == 0


def test_activation_checkpointing_adds_exactly_one_forward_of_the_blocks():
    builder = ModelBuilder.llama(SMALL)
    layout = Layout(world=8, batch=2, seq=128, grad_accum=3)
    costs = model_costs(layout, builder)
    plain = predict_step_time(layout, costs, HAND)
    ac = predict_step_time(dataclasses.replace(layout, activation_checkpointing=True), costs, HAND)
    one_forward = SMALL.n_layers * _compute(costs.block_forward, 2, 1, HAND)
    assert plain.recompute == 0 and ac.recompute == pytest.approx(3 * one_forward)
    assert ac.compute == plain.compute
    # By hand, one op: a roofline of FLOPs at peak or bytes at bandwidth, times the batch.
    op = max(costs.block_forward, key=lambda o: o.flops)
    assert _compute((op,), 2, 1, HAND) == max(2 * op.flops / 100e12, (2 * op.act_bytes + op.weight_bytes) / 1e12)


def test_parts_add_up_and_more_ranks_cost_what_they_must():
    builder = ModelBuilder.llama(SMALL)
    base = Layout(world=8, batch=2, seq=128)
    costs = model_costs(base, builder)
    steps = [predict_step_time(dataclasses.replace(base, world=w), costs, HAND) for w in (8, 16, 32, 64)]
    for s in steps:
        assert isinstance(s, StepTime)
        assert s.seconds == pytest.approx(s.compute + s.recompute + s.exposed_comm + s.bubble + s.optimizer)
        assert s.limit in ("compute", "communication", "bubble", "optimizer") and 0 < s.mfu < 1
        assert s.tokens_per_s_per_device == pytest.approx(2 * 128 / s.seconds)
    # The per-rank compute is the same; the rings only get longer (and leave the node at 16).
    assert len({round(s.compute, 12) for s in steps}) == 1
    assert all(a.exposed_comm <= b.exposed_comm for a, b in zip(steps, steps[1:]))
    assert steps[0].exposed_comm < steps[1].exposed_comm  # across nodes: 10x slower links
    # The optimizer's share shrinks with the shards; with free links nothing else changes.
    assert all(a.optimizer > b.optimizer for a, b in zip(steps, steps[1:]))
    free = [predict_step_time(dataclasses.replace(base, world=w), costs, FREE_LINKS) for w in (8, 64)]
    assert free[0].seconds - free[0].optimizer == pytest.approx(free[1].seconds - free[1].optimizer)


def test_predict_is_cheap():
    layout = Layout(world=64, batch=1, seq=8192, param_dtype=torch.bfloat16)
    costs = model_costs(layout, ModelBuilder.llama("llama3_8b"))
    start = time.perf_counter()
    for _ in range(100):
        predict_step_time(layout, costs, HARDWARE["h100"])
    assert (time.perf_counter() - start) / 100 < 0.01


@pytest.mark.parametrize("field, value, match", [
    ("intra_bandwidth", -1.0, r"intra_bandwidth must be a finite number > 0"),
    ("peak_flops", 0.0, r"peak_flops must be a finite number > 0"),
    ("inter_latency", float("nan"), r"inter_latency must be a finite number of seconds >= 0"),
    ("devices_per_node", 0, r"devices_per_node must be an int >= 1"),
    ("memory", 1.5, r"memory must be an int >= 1"),
    ("flops_efficiency", 1.5, r"flops_efficiency must be a fraction in \(0, 1\]"),
    ("op_overhead", -1e-6, r"op_overhead must be a finite number of seconds >= 0"),
    ("dtensor_op_overhead", float("inf"), r"dtensor_op_overhead must be a finite number of seconds >= 0"),
    ("oversubscription", 0.5, r"oversubscription must be a finite number >= 1"),
    ("attention_flops", -1.0, r"attention_flops must be a finite number >= 0 \(0: derived\)"),
])
def test_nonsensical_hardware_is_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(HAND, **{field: value})


def test_hardware_presets_json_round_trip_and_unknown_names(tmp_path):
    assert HARDWARE["h100"].peak_flops == 989e12 and HARDWARE["a100"].peak_flops == 312e12
    path = tmp_path / "hw.json"
    path.write_text(HAND.to_json())
    assert load_hardware(str(path)) == HAND and load_hardware("H100") is HARDWARE["h100"]
    with pytest.raises(ValueError, match="not a preset .* nor a JSON file"):
        load_hardware("b200")
    path.write_text(json.dumps({**json.loads(HAND.to_json()), "nvlink": 5}))
    with pytest.raises(ValueError, match="keys Hardware does not: \\['nvlink'\\]"):
        load_hardware(path)


def test_op_overhead_adds_its_seconds_per_op_and_tp_pays_the_dtensor_one():
    builder = ModelBuilder.llama(SMALL)
    layout = Layout(world=8, batch=2, seq=128, grad_accum=2)
    costs = model_costs(layout, builder)
    assert HAND.op_overhead == 0 and all(hw.op_overhead == hw.dtensor_op_overhead == 0 for hw in HARDWARE.values())
    slow = dataclasses.replace(HAND, op_overhead=10e-6, dtensor_op_overhead=50e-6)
    ops = {part: len(getattr(costs, part)) for part in ("block_forward", "block_backward", "rest_forward",
                                                         "rest_backward")}
    per_micro = SMALL.n_layers * (ops["block_forward"] + ops["block_backward"]) + ops["rest_forward"] + \
        ops["rest_backward"]
    # By hand: every op of both micro-batches once more, 10 us each; compute only, not the links.
    plain, with_host = (predict_step_time(layout, costs, hw) for hw in (HAND, slow))
    assert with_host.compute - plain.compute == pytest.approx(2 * per_micro * 10e-6)
    ac = dataclasses.replace(layout, activation_checkpointing=True)
    assert predict_step_time(ac, costs, slow).recompute - predict_step_time(ac, costs, HAND).recompute == \
        pytest.approx(2 * SMALL.n_layers * ops["block_forward"] * 10e-6)
    # Tensor parallelism splits the roofline, not the host's dispatch: its ops cost the DTensor figure.
    tp = dataclasses.replace(layout, tp=2)
    assert predict_step_time(tp, costs, slow).compute - predict_step_time(tp, costs, HAND).compute == \
        pytest.approx(2 * per_micro * 50e-6)
    # A profile saved before the field existed reads as 0 (no host overhead).
    old = {k: v for k, v in json.loads(HAND.to_json()).items() if not k.endswith("overhead")}
    assert Hardware.from_json(json.dumps(old)) == HAND


def test_group_and_parameter_overheads_by_hand():
    builder = ModelBuilder.llama(SMALL)
    layout = Layout(world=8, batch=2, seq=128, grad_accum=2)
    costs = model_costs(layout, builder)
    # A Llama block: wq, wk, wv, wo, w1, w2, w3 and two norms; the rest: embedding, final norm, output.
    assert (costs.block_tensors, costs.rest_tensors) == (9, 3)
    assert all(hw.group_overhead == hw.param_overhead == 0 for hw in HARDWARE.values())
    slow = dataclasses.replace(HAND, group_overhead=1e-3, param_overhead=1e-4)
    plain, with_host = (predict_step_time(layout, costs, hw) for hw in (HAND, slow))
    # Each of the blocks' groups and the root's, in forward and backward, once per micro-batch.
    assert with_host.compute - plain.compute == pytest.approx(2 * (SMALL.n_layers + 1) * 1e-3)
    # Every rank steps a shard of every tensor: 9 per block and 3 more, 0.1 ms each.
    assert with_host.optimizer - plain.optimizer == pytest.approx((9 * SMALL.n_layers + 3) * 1e-4)
    # Activation checkpointing recomputes a block's ops, not its group's hooks.
    ac = dataclasses.replace(layout, activation_checkpointing=True)
    assert predict_step_time(ac, costs, slow).recompute == pytest.approx(predict_step_time(ac, costs, HAND).recompute)
    # A pipeline rank holds half the blocks: half their tensors (and the rest's, as the heaviest stage).
    pp = Layout(world=8, batch=4, seq=128, pp=2)
    assert predict_step_time(pp, costs, slow).optimizer - predict_step_time(pp, costs, HAND).optimizer == \
        pytest.approx((9 * SMALL.n_layers // 2 + 3) * 1e-4)


def test_attention_flops_prices_the_fused_attention_alone():
    builder = ModelBuilder.llama(SMALL)
    layout = Layout(world=8, batch=2, seq=128)
    costs = model_costs(layout, builder)
    assert all(hw.attention_flops == 0 for hw in HARDWARE.values())  # 0: at the matmuls' rate
    slow = dataclasses.replace(HAND, attention_flops=HAND.peak_flops * HAND.flops_efficiency / 10)
    attention = [op for op in costs.block_forward + costs.block_backward if op.attention]
    assert len(attention) == 2  # one fused op forward, one backward
    # By hand: each block's two attention ops by the roofline with their FLOPs (per sequence, x
    # batch 2) 10x slower; every other op unchanged.
    rate, bandwidth = HAND.peak_flops * HAND.flops_efficiency, HAND.hbm_bandwidth * HAND.bandwidth_efficiency
    extra = SMALL.n_layers * sum(max(op.flops * 2 * 10 / rate, op.act_bytes * 2 / bandwidth)
                                 - max(op.flops * 2 / rate, op.act_bytes * 2 / bandwidth) for op in attention)
    assert extra > 0
    plain, with_attention = (predict_step_time(layout, costs, hw) for hw in (HAND, slow))
    assert with_attention.compute - plain.compute == pytest.approx(extra)


def test_layouts_the_costs_cannot_describe_are_refused():
    builder = ModelBuilder.llama(SMALL)
    layout = Layout(world=8, batch=2, seq=128)
    costs = model_costs(layout, builder)
    with pytest.raises(ValueError, match="counted for seq 128 .* call model_costs"):
        predict_step_time(dataclasses.replace(layout, seq=256), costs, HAND)
    with pytest.raises(ValueError, match="in torch.bfloat16: call model_costs"):
        predict_step_time(dataclasses.replace(layout, param_dtype=torch.bfloat16), costs, HAND)
    bf16 = dataclasses.replace(layout, param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="counted for seq 128 in torch.bfloat16, .* in torch.float32"):
        predict_step_time(layout, model_costs(bf16, builder), HAND)  # None: the parameters' own dtype
    three = ModelBuilder.llama(dataclasses.replace(SMALL, n_layers=6))
    pp = Layout(world=4, batch=4, seq=128, pp=4)
    with pytest.raises(ValueError, match="6 blocks cannot be split into pp 4"):
        predict_step_time(pp, model_costs(pp, three), HAND)
    with pytest.raises(TypeError, match="hardware must be a fsdp2.plan.Hardware"):
        predict_step_time(layout, costs, "h100")
    with pytest.raises(TypeError, match="builder must be a fsdp2.plan.ModelBuilder"):
        model_costs(layout, Transformer)


def _calibrate_on_group() -> dict:
    return dataclasses.asdict(calibrate(group=dist.group.WORLD, comm_bytes=2**20))


def _check_measured(figures: dict) -> None:
    for name in ("peak_flops", "hbm_bandwidth", "intra_bandwidth", "intra_latency", "inter_bandwidth",
                 "op_overhead", "dtensor_op_overhead", "group_overhead", "param_overhead", "attention_flops"):
        assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures)
    assert figures["flops_efficiency"] == figures["link_efficiency"] == 1.0


def test_calibrate_on_a_process_group_gives_positive_finite_figures():
    first, second = run_on_ranks(_calibrate_on_group, 2)
    _check_measured(first)
    assert first["devices_per_node"] == 2 and first["op_overhead"] < 1e-2
    assert (first["intra_bandwidth"], first["intra_latency"]) == (second["intra_bandwidth"], second["intra_latency"])


@pytest.mark.slow
def test_cli_calibrate_spawns_two_ranks_and_saves_a_profile(tmp_path, capsys):
    path = tmp_path / "machine.json"
    assert main(["--calibrate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "hardware: calibrated: 2 CPU ranks" in out and f"saved to {path}" in out
    _check_measured(json.loads(path.read_text()))
    assert load_hardware(str(path)).devices_per_node == 2


def test_cli_hardware_h100_prints_tokens_per_second_and_mfu(capsys):
    assert main(["--config", "llama3_8b", "--world", "64", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    time_lines = out[out.index("time: on H100"):]
    assert "tokens/s per device" in time_lines and "MFU" in time_lines and "limited by" in time_lines
    assert main(["--config", "llama3_8b", "--world", "64"]) == 0
    assert "time:" not in capsys.readouterr().out  # no --hardware: the output as before
    with pytest.raises(SystemExit):
        main(["--config", "llama3_8b", "--world", "64", "--hardware", "tpu"])
    assert "not a preset" in capsys.readouterr().err


def test_reshard_per_node_regathers_over_the_node_links():
    # 16 ranks on 2 nodes of 8, dp_shard 16. reshard_after_forward=8: after forward each rank keeps
    # 1/8 of a block's parameters, and backward gathers them again over its node's 8 ranks (ranks
    # 0-7, 8-15: consecutive on the shard axis), a ring on the intra-node links: 7/8 of the block's
    # fp32 bytes at 100 GB/s plus 7 x 1 us. Forward's gather stays over all 16, across the nodes.
    per_node = Layout(world=16, batch=1, seq=32, reshard_after_forward=8)
    costs = model_costs(per_node, _linears())
    links = _Links(per_node, HAND)
    assert links.axes["reshard"] == (8, 1) and not links.crosses("reshard") and links.crosses("dp_shard")
    block, root = _fsdp(per_node, costs, links)
    nbytes = costs.block_params * 4
    assert block.regather == pytest.approx(7 / 8 * nbytes / 100e9 + 7 * 1e-6)
    assert block.gather == pytest.approx(15 / 16 * nbytes / 10e9 + 15 * 1e-5)
    assert root.regather == 0  # the root keeps its parameters (root_reshard_after_forward False)
    full = dataclasses.replace(per_node, reshard_after_forward=True)
    block_full, _ = _fsdp(full, costs, _Links(full, HAND))
    assert block_full.regather == block.gather
    # The blocks are tiny: every backward collective is exposed. With 2 blocks, backward waits for
    # the first block's re-gather and then for the second block's (with the first's reduce-scatter
    # in flight): the step saves twice the difference between the two gathers.
    steps = {r: predict_step_time(dataclasses.replace(per_node, reshard_after_forward=r), costs, HAND)
             for r in (True, 8, False)}
    assert steps[True].seconds - steps[8].seconds == pytest.approx(2 * (block.gather - block.regather))
    assert steps[False].seconds < steps[8].seconds < steps[True].seconds
    # Per node over 4 nodes of 8 (32 ranks) is the same ring; resharding to 16 ranks leaves the node.
    assert _Links(dataclasses.replace(per_node, world=32), HAND).link("reshard") == (100e9, 1e-6)
    assert _Links(dataclasses.replace(per_node, world=32, reshard_after_forward=16), HAND).crosses("reshard")
    # Pipelined (pp 2 x dp_shard 16 on 4 nodes, one block per stage, 2 microbatches): each
    # microbatch's backward gathers the stage's block again, over 8 ranks instead of 16.
    pipe = dataclasses.replace(per_node, world=32, batch=2, pp=2)
    pipe_block, _ = _fsdp(pipe, costs, _Links(pipe, HAND))
    assert pipe_block.regather == block.regather and pipe_block.gather == block.gather
    pipe_steps = {r: predict_step_time(dataclasses.replace(pipe, reshard_after_forward=r), costs, HAND)
                  for r in (True, 8)}
    assert pipe_steps[True].seconds - pipe_steps[8].seconds == pytest.approx(2 * (block.gather - block.regather))
