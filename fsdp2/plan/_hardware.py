"""What the step-time model knows of a machine: a ``Hardware`` profile, presets, and ``calibrate``.

A profile holds per-device figures: dense FLOP/s at the compute dtype, memory bandwidth,
devices per node, and the bandwidth and per-step latency of a collective inside a node and
across nodes. The presets hold datasheet peaks with the fractions of them a training step
reaches (``*_efficiency``, stated below); ``calibrate()`` measures this machine instead, so
its fractions are 1 (what it measured is what a step gets).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Hardware", "HARDWARE", "load_hardware"]

_FLOATS = ("peak_flops", "hbm_bandwidth", "intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency",
           "op_overhead", "dtensor_op_overhead", "group_overhead", "param_overhead", "attention_flops")
# Figures whose 0 means "derive it": from peak_flops with its efficiency.
_DERIVED = ("attention_flops",)
_FRACTIONS = ("flops_efficiency", "bandwidth_efficiency", "link_efficiency")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device of a cluster, as the step-time model (``predict_step_time``) sees it.

    Args:
        name: what it is, for the output.
        peak_flops: dense FLOP/s per device at the compute dtype (bf16 on GPUs; fp32 on CPUs).
        hbm_bandwidth: bytes/s per device between memory and the compute units.
        devices_per_node: devices that share the fast links (NVLink); mesh axes fill a node from
            the innermost (tp) outwards, as ``init_device_mesh`` lays ranks out.
        intra_bandwidth: bytes/s per device, one direction, to the other devices of its node.
        intra_latency: seconds each step of a ring collective inside a node costs besides its bytes.
        inter_bandwidth: bytes/s per device, one direction, to other nodes (its share of the NICs).
        inter_latency: seconds per ring step when the ring crosses nodes.
        memory: bytes per device.
        flops_efficiency: the fraction of ``peak_flops`` a training step's matmuls reach
            (cuBLAS on large bf16 GEMMs: about 0.6-0.8 of the datasheet's dense peak).
        bandwidth_efficiency: the fraction of ``hbm_bandwidth`` memory-bound kernels reach (~0.8).
        link_efficiency: the fraction of the link bandwidths NCCL's ring collectives reach (~0.8).
        op_overhead: seconds of host time each op costs besides its roofline (eager dispatch:
            Python, the dispatcher, autograd). Added to every op, since a CPU rank runs the host
            and the kernel on one core; 0 in the GPU presets, whose host work runs ahead of the
            kernels (launch-bound tiny models excepted). ``calibrate`` measures it.
        dtensor_op_overhead: the same for an op of a tensor-parallel block (DTensor's sharding
            propagation, the redistributions and their collectives' host work), used in place
            of ``op_overhead`` when tp > 1.
        group_overhead: host seconds an FSDP group costs per forward and backward besides its
            ops and its collectives' bytes: its hooks, issuing and waiting for its collectives,
            copying into and out of its buffers (0 in the GPU presets: it runs ahead of the kernels).
        param_overhead: host seconds the optimizer step and the gradient clip cost per
            parameter tensor besides the bytes they read and write (torch's optimizers loop over
            the tensors on CPU, one DTensor dispatch per op; 0 in the GPU presets: foreach
            kernels, ahead of the device).
        oversubscription: how many times faster a rank runs while its peers idle, where ranks
            share cores (a CPU host with more ranks than cores, or other work on it; ``calibrate``
            measures it): the compute figures are what each rank gets with all of them busy, and
            a pipeline's bubble lends the idle ranks' cores to the busy ones. 1 on GPUs.
        attention_flops: FLOP/s a fused attention reaches, forward and backward (as
            ``model_costs`` counts them: the causal half); 0 (the presets): ``peak_flops x
            flops_efficiency``. A CPU's flash kernel runs far below its matmuls; ``calibrate`` times it.
    """

    name: str
    peak_flops: float
    hbm_bandwidth: float
    devices_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    memory: int
    flops_efficiency: float = 0.7
    bandwidth_efficiency: float = 0.8
    link_efficiency: float = 0.8
    op_overhead: float = 0.0
    dtensor_op_overhead: float = 0.0
    group_overhead: float = 0.0
    param_overhead: float = 0.0
    oversubscription: float = 1.0
    attention_flops: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Hardware.name must be a non-empty str, got {self.name!r}")
        for field in _FLOATS:
            value = getattr(self, field)
            latency = field.endswith("latency") or field.endswith("overhead") or field in _DERIVED
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and not latency):
                need = ("a finite number >= 0 (0: derived)" if field in _DERIVED else
                        "a finite number of seconds >= 0" if latency else "a finite number > 0")
                raise ValueError(f"Hardware.{field} must be {need}, got {value!r}: give it in "
                                 f"{'seconds' if latency else 'units per second (e.g. 450e9 bytes/s)'}")
        for field in ("devices_per_node", "memory"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Hardware.{field} must be an int >= 1, got {value!r}"
                                 + (" (bytes per device, e.g. 80 * 2**30)" if field == "memory" else
                                    " (devices sharing a node's fast links; 1 for one device per node)"))
        over = self.oversubscription
        if isinstance(over, bool) or not isinstance(over, (int, float)) or not math.isfinite(over) or over < 1:
            raise ValueError(f"Hardware.oversubscription must be a finite number >= 1 (ranks per core; 1 where "
                             f"each rank has its own device), got {over!r}")
        for field in _FRACTIONS:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ValueError(f"Hardware.{field} must be a fraction in (0, 1], got {value!r} "
                                 "(1: the figures given are what a step reaches)")

    def to_json(self) -> str:
        """The profile as a JSON object (``load_hardware(path)`` reads it back)."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"a Hardware profile must be a JSON object, cannot read it: {e}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or set(data) - known:
            extra = sorted(set(data) - known) if isinstance(data, dict) else data
            raise ValueError(f"a Hardware profile's JSON has keys Hardware does not: {extra}; expected {sorted(known)}")
        return cls(**data)


_GiB = 2**30
HARDWARE: dict[str, Hardware] = {
    # NVIDIA H100 SXM5 80GB datasheet: 989.4 TFLOP/s dense bf16 (1,979 with sparsity), 3.35 TB/s
    # HBM3, NVLink 4 at 900 GB/s both directions (450 one way); DGX H100: 8 GPUs per node, one
    # ConnectX-7 400 Gb/s (50 GB/s) NIC per GPU. Latencies: NCCL's per-step figures, typical.
    "h100": Hardware(name="H100 SXM 80GB (8 per node, NVLink 4, 8x400Gb/s IB)", peak_flops=989e12,
                     hbm_bandwidth=3.35e12, devices_per_node=8, intra_bandwidth=450e9, intra_latency=5e-6,
                     inter_bandwidth=50e9, inter_latency=10e-6, memory=80 * _GiB),
    # NVIDIA H200 SXM 141GB datasheet: the H100 SXM's compute (989.4 TFLOP/s dense bf16) with
    # 4.8 TB/s HBM3e; HGX H200: 8 GPUs per node on NVLink 4, one 400 Gb/s NIC per GPU. Memory: what
    # the device reports (143,771 MiB, about 140 GiB), not the datasheet's 141 GB.
    "h200": Hardware(name="H200 SXM 141GB (8 per node, NVLink 4, 8x400Gb/s IB)", peak_flops=989e12,
                     hbm_bandwidth=4.8e12, devices_per_node=8, intra_bandwidth=450e9, intra_latency=5e-6,
                     inter_bandwidth=50e9, inter_latency=10e-6, memory=140 * _GiB),
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s dense bf16, 2.039 TB/s HBM2e, NVLink 3 at
    # 600 GB/s both directions (300 one way); DGX A100: 8 GPUs per node, 8 ConnectX-6 200 Gb/s
    # (25 GB/s) HDR NICs for compute traffic, one per GPU.
    "a100": Hardware(name="A100 SXM 80GB (8 per node, NVLink 3, 8x200Gb/s IB)", peak_flops=312e12,
                     hbm_bandwidth=2.039e12, devices_per_node=8, intra_bandwidth=300e9, intra_latency=5e-6,
                     inter_bandwidth=25e9, inter_latency=10e-6, memory=80 * _GiB),
    # The H100 of Meta's Grand Teton hosts, where torchtitan measured its published runs
    # (pytorch/torchtitan docs/performance.md @ eaea6f6, Dec 2024): 96 GB HBM2e at 2.4 TB/s, the
    # default 500 W power limit (the SXM5's TDP is 700 W), 8 per host on NVLink, 400 Gb/s RDMA per
    # GPU. Its dense bf16 peak is "between SXM and NVL" (ibid.), unknown: taken halfway between
    # the H100 SXM5's 989.4 and the H100 NVL's 835.5 TFLOP/s (datasheets), 912 TFLOP/s.
    "h100_96gb_500w": Hardware(name="H100 96GB HBM2e at 500 W (8 per node, NVLink 4, 8x400Gb/s RDMA)",
                               peak_flops=912e12, hbm_bandwidth=2.4e12, devices_per_node=8, intra_bandwidth=450e9,
                               intra_latency=5e-6, inter_bandwidth=50e9, inter_latency=10e-6, memory=96 * _GiB),
}


def load_hardware(spec: str | Path | Hardware) -> Hardware:
    """A profile by preset name ("h100", "h200", "a100", "h100_96gb_500w"), or read from a JSON file
    ``calibrate`` saved."""
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, str) and spec.lower() in HARDWARE:
        return HARDWARE[spec.lower()]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"hardware {str(spec)!r}: not a preset ({', '.join(sorted(HARDWARE))}) nor a JSON file; "
                         "python -m fsdp2.plan --calibrate FILE.json writes one for this machine")
    return Hardware.from_json(path.read_text())
