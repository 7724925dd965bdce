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
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["Hardware", "HARDWARE", "calibrate", "load_hardware"]

_FLOATS = ("peak_flops", "hbm_bandwidth", "intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency",
           "op_overhead", "dtensor_op_overhead")
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
            Python, the dispatcher, DTensor's sharding propagation). Added to every op, since a
            CPU rank runs the host and the kernel on one core; 0 in the GPU presets, whose host
            work runs ahead of the kernels (launch-bound tiny models excepted). ``calibrate``
            measures it.
        dtensor_op_overhead: the same for an op on DTensors (tensor parallelism's: sharding
            propagation and redistribution checks), used in place of ``op_overhead`` when tp > 1.
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

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Hardware.name must be a non-empty str, got {self.name!r}")
        for field in _FLOATS:
            value = getattr(self, field)
            latency = field.endswith("latency") or field.endswith("overhead")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (value == 0 and not latency):
                need = "a finite number of seconds >= 0" if latency else "a finite number > 0"
                raise ValueError(f"Hardware.{field} must be {need}, got {value!r}: give it in "
                                 f"{'seconds' if latency else 'units per second (e.g. 450e9 bytes/s)'}")
        for field in ("devices_per_node", "memory"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Hardware.{field} must be an int >= 1, got {value!r}"
                                 + (" (bytes per device, e.g. 80 * 2**30)" if field == "memory" else
                                    " (devices sharing a node's fast links; 1 for one device per node)"))
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
    """A profile by preset name ("h100", "a100", "h100_96gb_500w"), or read from a JSON file ``calibrate`` saved."""
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, str) and spec.lower() in HARDWARE:
        return HARDWARE[spec.lower()]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"hardware {str(spec)!r}: not a preset ({', '.join(sorted(HARDWARE))}) nor a JSON file; "
                         "python -m fsdp2.plan --calibrate FILE.json writes one for this machine")
    return Hardware.from_json(path.read_text())


# ---- measuring this machine ------------------------------------------------------------------
def _median(fn, repeats: int) -> float:
    """The median of ``repeats`` timed runs (seconds): what a rank sharing its core gets, typically."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _loop(fn, repeats: int) -> float:
    """Seconds per run of ``repeats`` back-to-back runs, timed as a whole: with every rank running
    its loop at once, a rank sharing its core with others gets its share of it, waits included."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _matmul_flops(n: int = 1024, dtype: torch.dtype = torch.float32) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _loop(lambda: torch.mm(a, b), 8)


def _copy_bandwidth(nbytes: int = 64 * 2**20) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _loop(lambda: dst.copy_(src), 8)  # read once, written once


def _op_overhead(group: dist.ProcessGroup | None = None, chain: int = 100) -> float:
    """Seconds per op of a chain of one-element ops, forward and backward under autograd: what
    eager mode costs an op besides its work (Python, the dispatcher, autograd's bookkeeping);
    with ``group``, on a DTensor replicated over it (no communication: every op stays local)."""
    x = torch.zeros(1, requires_grad=True)
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, distribute_tensor

        mesh = DeviceMesh.from_group(group, "cpu")
        x = distribute_tensor(torch.zeros(1), mesh, [Replicate()]).requires_grad_()

    def run() -> None:
        y = x
        for _ in range(chain):
            y = y * 1.0
        y.backward()

    return _loop(run, 5) / (2 * chain)  # each op forward, and its backward


def _collective(group: dist.ProcessGroup | None, nbytes: int) -> tuple[float, float]:
    """(bandwidth, latency per ring step) of all-reduces on ``group``, all its ranks calling.

    An all-reduce of B bytes on n ranks takes 2 (n - 1) / n x B / bandwidth + 2 (n - 1) x latency:
    a one-element one gives the latency, a large one the bandwidth (medians: where ranks share
    cores, a collective waits for its peers to be scheduled, as in training). Every rank takes
    rank 0's figures.
    """
    n = dist.get_world_size(group)
    small, large = torch.zeros(1), torch.zeros(nbytes // 4)

    def timed(t: torch.Tensor, repeats: int) -> float:
        dist.barrier(group=group)
        return _median(lambda: dist.all_reduce(t, group=group), repeats)

    t_small, t_large = timed(small, 20), timed(large, 5)
    latency = t_small / (2 * (n - 1))
    bandwidth = 2 * (n - 1) / n * nbytes / max(t_large - 2 * (n - 1) * latency, 1e-9)
    figures = torch.tensor([bandwidth, latency], dtype=torch.float64)
    dist.broadcast(figures, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return float(figures[0]), float(figures[1])


def _measure(group: dist.ProcessGroup | None, nbytes: int) -> tuple[float, ...]:
    """(flops, memory bandwidth, op overhead, DTensor op overhead, link bandwidth, link latency), every
    rank of ``group``
    calling: the compute figures measured on all ranks at once, one thread each, so that ranks
    sharing cores (more ranks than cores) see what each gets in training; their mean."""
    bandwidth, latency = _collective(group, nbytes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per rank, as the CPU training recipe runs them
    try:
        dist.barrier(group=group)
        local = torch.tensor([_matmul_flops(), _copy_bandwidth(), _op_overhead(),
                              _op_overhead(group or dist.group.WORLD)], dtype=torch.float64)
    finally:
        torch.set_num_threads(threads)
    dist.all_reduce(local, group=group)
    local /= dist.get_world_size(group)
    return (*(float(x) for x in local), bandwidth, latency)


def _rank(rank: int, world: int, store_path: str, nbytes: int, out: object) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        figures = _measure(None, nbytes)
        if rank == 0:
            out.put(figures)  # type: ignore[attr-defined]
    finally:
        dist.destroy_process_group()


def _spawned(world: int, nbytes: int, timeout: float) -> tuple[float, ...]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank, args=(r, world, store, nbytes, out), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        try:
            figures = out.get(timeout=timeout)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return figures


def calibrate(*, world: int = 2, group: dist.ProcessGroup | None = None, comm_bytes: int = 16 * 2**20,
              timeout: float = 300.0, name: str | None = None) -> Hardware:
    """Measure this machine: a ``Hardware`` profile whose figures are what it reaches (efficiencies 1).

    ``peak_flops``: fp32 1024x1024 matmuls on the CPU, ``hbm_bandwidth``: a 64 MiB copy (bytes
    read plus written per second), ``op_overhead`` (and ``dtensor_op_overhead``): a chain of
    one-element ops (on a replicated DTensor) forward and backward, per op; these on every rank
    at once, one thread each, each loop timed as a whole (ranks that share cores, with each other
    or with other work, get their share), averaged over the ranks; and the collectives' median bandwidth and
    latency: gloo all-reduces of one element and of ``comm_bytes`` between ``world`` local
    processes it spawns, or on ``group`` when given (then every rank of it must call, and all
    get rank 0's figures). One host: ``devices_per_node`` is the ranks measured and the
    inter-node figures are the intra-node ones. ``memory``: the host's RAM divided by those ranks.

    Args:
        world: ranks to spawn (at least 2); ignored with ``group``.
        group: an existing gloo process group to measure instead of spawning.
        comm_bytes: bytes of the large all-reduce.
        timeout: seconds to wait for the spawned ranks.
        name: the profile's name (default: "calibrated: <world> CPU ranks").
    """
    if group is None and (not isinstance(world, int) or isinstance(world, bool) or world < 2):
        raise ValueError(f"calibrate(world=...) must be an int >= 2 (ranks whose collectives are timed), got {world!r}")
    if group is not None:
        world = dist.get_world_size(group)
        flops, hbm, overhead, dtensor, bandwidth, latency = _measure(group, comm_bytes)
    else:
        flops, hbm, overhead, dtensor, bandwidth, latency = _spawned(world, comm_bytes, timeout)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(name=name or f"calibrated: {world} CPU ranks", peak_flops=flops, hbm_bandwidth=hbm,
                    devices_per_node=world, intra_bandwidth=bandwidth, intra_latency=latency,
                    inter_bandwidth=bandwidth, inter_latency=latency, memory=max(1, ram // world),
                    flops_efficiency=1.0, bandwidth_efficiency=1.0, link_efficiency=1.0, op_overhead=overhead,
                    dtensor_op_overhead=dtensor)
