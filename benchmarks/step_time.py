"""Per-step wall time and memory of fsdp2 against torch's FSDP2, DDP and no communication.

    torchrun --nproc-per-node 2 benchmarks/step_time.py [--dim 384 --layers 6 ...] [--sweep]

One launch builds the same GPT-style transformer four ways, each with its own AdamW:

- ``fsdp2``:       ``fsdp2.fully_shard`` per block, then the root (``--wrap titan``: as torchtitan);
- ``torch_fsdp2``: ``torch.distributed.fsdp.fully_shard``, applied the same way;
- ``ddp``:         ``torch.nn.parallel.DistributedDataParallel``;
- ``nocomm``:      the plain model, each rank training its own copy (the compute-only floor).

Their steps are interleaved round-robin (one step of each per round, the starting
implementation rotating every round) so a noisy machine slows all of them alike. A step
is forward + backward + ``optimizer.step()`` (plus ``zero_grad``), timed on every rank
after a ``dist.barrier()``; a step's time is the slowest rank's, and the medians over the
rounds after ``--warmup`` are reported. Rank 0 prints one JSON line per configuration
(see benchmarks/README.md for the fields).

``--device cpu`` runs on gloo; ``--device cuda`` on NCCL, one GPU per rank (``LOCAL_RANK``),
synchronising the device before each step's clock stops, and stops with an error where
CUDA or enough GPUs are missing; ``--device auto`` (the default) takes CUDA when present.
The CUDA path has run on one H100 (``benchmarks/gpu_check.sh``), not yet on several GPUs::

    torchrun --nproc-per-node 2 benchmarks/step_time.py --device cuda --impls fsdp2,torch_fsdp2
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

IMPLS = ("fsdp2", "torch_fsdp2", "ddp", "nocomm")
# Not run unless named: fsdp2 on a process group of its own whose reads send their small
# messages over gloo instead of pipes (FSDP2_CPU_PIPES=0), to compare the two in one launch.
EXTRA_IMPLS = ("fsdp2_gloo",)
RATIOS = (("fsdp2", "torch_fsdp2"), ("fsdp2", "ddp"), ("fsdp2", "nocomm"),
          ("torch_fsdp2", "nocomm"), ("ddp", "nocomm"), ("fsdp2", "fsdp2_gloo"))


# ---- model ------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm block: causal self-attention, then a GELU MLP (4x hidden)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        # (batch, heads, seq, head_dim)
        q, k, v = (t.view(b, s, self.n_heads, d // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, final norm, untied head."""

    def __init__(self, vocab: int, dim: int, n_layers: int, n_heads: int, seq: int) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (batch, seq) -> logits: (batch, seq, vocab)
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    layers: int
    heads: int
    vocab: int
    seq: int
    batch: int  # sequences per rank per step

    def __post_init__(self) -> None:
        if min(asdict(self).values()) < 1:
            raise ValueError(f"every model option must be >= 1, got {self}")
        if self.dim % self.heads:
            raise ValueError(f"--dim {self.dim} must be divisible by --heads {self.heads}")


# Parameter counts in the comments are what the model above builds (embeddings included).
PRESETS = {
    "tiny": ModelConfig(dim=64, layers=2, heads=4, vocab=256, seq=32, batch=2),      # ~0.13M
    "5M": ModelConfig(dim=256, layers=4, heads=4, vocab=4096, seq=128, batch=2),     # ~5.3M
    "17M": ModelConfig(dim=384, layers=6, heads=6, vocab=8192, seq=128, batch=2),    # ~16.9M
    "50M": ModelConfig(dim=640, layers=8, heads=10, vocab=8192, seq=128, batch=2),   # ~49.9M
    "100M": ModelConfig(dim=768, layers=12, heads=12, vocab=8192, seq=128, batch=2),  # ~97.6M
}
DEFAULT_SWEEP = "5M,17M,50M,100M"


# ---- the four implementations -----------------------------------------------------------
WRAPS = ("blocks", "titan")


def shard_model(model: GPT, mesh: DeviceMesh, fully_shard: Callable, how: str = "blocks") -> nn.Module:
    """``blocks``: each block, then the root (embeddings, final norm, head in one group).

    ``titan``: as torchtitan does: the embeddings, each block, the final norm with the head,
    then the root (no parameters of its own); the last block and the head are not resharded
    after forward, since backward needs them first.
    """
    if how == "titan":
        fully_shard([model.tok_emb, model.pos_emb], mesh=mesh)
        for i, block in enumerate(model.layers):
            fully_shard(block, mesh=mesh, reshard_after_forward=i < len(model.layers) - 1)
        fully_shard([model.norm, model.output], mesh=mesh, reshard_after_forward=False)
        return fully_shard(model, mesh=mesh)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)  # the root: embeddings, final norm, head


def wrap(impl: str, model: GPT, mesh: DeviceMesh, device: torch.device, how: str = "blocks") -> nn.Module:
    if impl == "fsdp2":
        from fsdp2 import fully_shard
        return shard_model(model, mesh, fully_shard, how)
    if impl == "fsdp2_gloo":
        from fsdp2 import fully_shard
        group = dist.new_group(dist.get_process_group_ranks(mesh.get_group()))
        own = DeviceMesh.from_group(group, mesh.device_type, mesh_dim_names=("gloo_messages",))
        return shard_model(model, own, fully_shard, how)
    if impl == "torch_fsdp2":
        from torch.distributed.fsdp import fully_shard
        return shard_model(model, mesh, fully_shard, how)
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if impl == "nocomm":
        return model
    raise ValueError(f"unknown implementation {impl!r}; choose from {', '.join(IMPLS)}")


@contextlib.contextmanager
def _pipes_off(off: bool) -> Iterator[None]:
    """``FSDP2_CPU_PIPES=0`` inside the block when ``off``."""
    before = os.environ.get("FSDP2_CPU_PIPES")
    if off:
        os.environ["FSDP2_CPU_PIPES"] = "0"
    try:
        yield
    finally:
        if off:
            if before is None:
                del os.environ["FSDP2_CPU_PIPES"]
            else:
                os.environ["FSDP2_CPU_PIPES"] = before


def make_batch(rank: int, step: int, cfg: ModelConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets), different per (rank, step), identical for every implementation."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    # zero_grad first, so the gradients of the last step stay alive for the memory count.
    opt.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    loss.backward()
    opt.step()
    return loss.detach()


# ---- measurements -----------------------------------------------------------------------
def _local_bytes(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    """[params, grads, optimizer state] bytes this rank holds (local shards of DTensors)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    optim = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [sum(_local_bytes(t) for t in ts) for ts in (params, grads, optim)]


def gather_rows(values: list[float], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Stack every rank's ``values``: (world, len(values)). Uses the default group."""
    local = torch.tensor(values, dtype=dtype)
    if dist.get_backend() == "nccl":
        local = local.cuda()
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, local)
    return torch.stack(rows).cpu()


def peak_rss_mb() -> float:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    scale = 1 / 1024 ** 2 if sys.platform == "darwin" else 1 / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def minor_faults() -> int:
    """Page faults served without I/O so far in this process: mostly the kernel handing out
    (and zeroing) fresh pages after the allocator gave memory back to the OS."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def keep_freed_memory() -> None:
    """Tell glibc's malloc to keep freed memory in the process (no trimming of the heap, no
    mmap for blocks under 1 GiB), so a step does not pay the kernel for fresh pages because
    the implementation stepped before it shrank the heap. Applies to every implementation."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    if libc is None or not hasattr(libc, "mallopt") or not (
            libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 30)):
        raise SystemExit("--malloc keep needs glibc's mallopt(); run with --malloc default")


def run_config(cfg: ModelConfig, impls: list[str], steps: int, warmup: int,
               mesh: DeviceMesh, device: torch.device, how: str = "blocks", foreach: bool | None = None,
               malloc: str = "default") -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank and for every implementation
    base = GPT(cfg.vocab, cfg.dim, cfg.layers, cfg.heads, cfg.seq).to(device)
    n_params = sum(p.numel() for p in base.parameters())
    models = {impl: wrap(impl, copy.deepcopy(base), mesh, device, how) for impl in impls}
    del base
    opts = {impl: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=foreach) for impl, m in models.items()}

    times = {impl: [] for impl in impls}
    faults = {impl: [] for impl in impls}
    step_peak = dict.fromkeys(impls, 0)  # CUDA: the most a step allocated beyond what it started with
    losses: dict[str, torch.Tensor] = {}
    for rnd in range(warmup + steps):
        inputs, targets = make_batch(rank, rnd, cfg, device)
        for k in range(len(impls)):
            impl = impls[(rnd + k) % len(impls)]  # rotate who goes first
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            faulted = minor_faults()
            start = time.perf_counter()
            with _pipes_off(impl == "fsdp2_gloo"):  # its group connects at its first all-gather
                losses[impl] = train_step(models[impl], opts[impl], inputs, targets)
            if device.type == "cuda":
                torch.cuda.synchronize()
                if rnd >= warmup:  # a warm-up step also pays one-time costs (cuBLAS's workspace, AdamW's state)
                    step_peak[impl] = max(step_peak[impl], torch.cuda.max_memory_allocated() - held)
            elapsed = time.perf_counter() - start
            if rnd >= warmup:
                times[impl].append(elapsed)
                faults[impl].append(minor_faults() - faulted)

    # A step lasts until its slowest rank is done.
    per_step = {impl: gather_rows(times[impl]).max(dim=0).values.tolist() for impl in impls}
    median = {impl: statistics.median(per_step[impl]) for impl in impls}
    faulted = {impl: statistics.median(gather_rows(faults[impl]).max(dim=0).values.tolist()) for impl in impls}
    quartiles = {impl: statistics.quantiles(per_step[impl], n=4) if steps > 1 else [median[impl]] * 3
                 for impl in impls}
    mem = {impl: gather_rows(state_bytes(models[impl], opts[impl]), torch.int64) for impl in impls}
    rss = gather_rows([peak_rss_mb()])[:, 0].tolist()
    result = {
        "config": {**asdict(cfg), "params": n_params, "world": world, "steps": steps, "warmup": warmup, "wrap": how,
                   "foreach": foreach, "malloc": malloc,
                   "device": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__},
        "median_s": {impl: round(median[impl], 5) for impl in impls},
        "iqr_s": {impl: [round(quartiles[impl][0], 5), round(quartiles[impl][2], 5)] for impl in impls},
        "ratio": {f"{a}/{b}": round(median[a] / median[b], 3) for a, b in RATIOS if a in impls and b in impls},
        "minor_faults_per_step": {impl: int(faulted[impl]) for impl in impls},
        "peak_rss_mb": [round(r, 1) for r in rss],
        "memory": {impl: {"params_bytes": m[:, 0].tolist(), "grads_bytes": m[:, 1].tolist(),
                          "optim_bytes": m[:, 2].tolist(), "total_bytes": m.sum(dim=1).tolist()}
                   for impl, m in mem.items()},
        "last_loss_rank0": {impl: round(losses[impl].item(), 5) for impl in impls},
    }
    if device.type == "cuda":
        # torch.cuda.max_memory_allocated during a step, less what was allocated when it began (the
        # other implementations' models included): activations, gathered parameters, gradients.
        peaks = gather_rows([step_peak[impl] for impl in impls], torch.int64)
        result["config"]["gpu"] = torch.cuda.get_device_name()
        result["step_peak_cuda_bytes"] = {impl: peaks[:, i].tolist() for i, impl in enumerate(impls)}
    del models, opts, losses
    gc.collect()
    return result


# ---- entry point ------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = PRESETS["17M"]
    p.add_argument("--dim", type=int, default=d.dim)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--vocab", type=int, default=d.vocab)
    p.add_argument("--seq", type=int, default=d.seq)
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each implementation)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"comma-separated subset of {','.join(IMPLS + EXTRA_IMPLS)} (fsdp2_gloo: fsdp2 with its "
                        "reads' small messages on gloo instead of pipes, on a process group of its own)")
    p.add_argument("--sweep", nargs="?", const=DEFAULT_SWEEP, default=None, metavar="NAMES",
                   help=f"run presets instead of --dim.. --batch; bare --sweep means {DEFAULT_SWEEP}; "
                        f"known: {','.join(PRESETS)}")
    p.add_argument("--wrap", choices=WRAPS, default="blocks",
                   help="how the FSDP implementations group parameters: each block then the root (default), "
                        "or torchtitan's grouping (embeddings, blocks, norm+head, root)")
    p.add_argument("--foreach", action="store_true",
                   help="AdamW(foreach=True) for every implementation (torch's default on GPUs; on CPU "
                        "the default is a loop over the parameters, one op at a time)")
    p.add_argument("--malloc", choices=("default", "keep"), default="default",
                   help="keep: glibc keeps freed memory in the process for every implementation (no fresh "
                        "pages each step because another implementation shrank the heap; see docs/performance.md)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cpu: gloo; cuda: NCCL, one GPU per rank (an error without CUDA); auto: cuda when present")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args(argv)
    args.impls = [i for i in args.impls.split(",") if i]
    unknown = [i for i in args.impls if i not in IMPLS + EXTRA_IMPLS]
    if unknown or not args.impls or len(set(args.impls)) != len(args.impls):
        p.error(f"--impls: give distinct names from {','.join(IMPLS)}, got {args.impls}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and "fsdp2_gloo" in args.impls:
        p.error("--impls fsdp2_gloo compares CPU transports; it has no meaning with --device cuda")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.sweep is not None:
        names = [n for n in args.sweep.split(",") if n]
        bad = [n for n in names if n not in PRESETS]
        if bad or not names:
            p.error(f"--sweep: unknown preset(s) {bad}; known: {','.join(PRESETS)}")
        args.configs = [PRESETS[n] for n in names]
    else:
        try:
            args.configs = [ModelConfig(args.dim, args.layers, args.heads, args.vocab, args.seq, args.batch)]
        except ValueError as e:
            p.error(str(e))
    return args


def check_cuda() -> None:
    """``--device cuda``: stop with what is missing (before any process group exists)."""
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__}, built with CUDA {torch.version.cuda}); run on a GPU "
                         "machine, or use --device cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() < local_world:
        raise SystemExit(f"--device cuda: {local_world} ranks on this host but {torch.cuda.device_count()} "
                         "GPU(s); NCCL needs one GPU per rank: lower --nproc-per-node")


def main() -> None:
    args = parse_args()
    if args.malloc == "keep":
        keep_freed_memory()
    use_cuda = args.device == "cuda"
    if use_cuda:
        check_cuda()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    world = dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        # Ranks share the machine's cores; oversubscribing them would time thread thrashing.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp_shard",))
    try:
        for cfg in args.configs:
            result = run_config(cfg, args.impls, args.steps, args.warmup, mesh, device, args.wrap,
                                True if args.foreach else None, args.malloc)
            if dist.get_rank() == 0:
                line = json.dumps(result)
                print(line, flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(line + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # recipes/, next to benchmarks/
    from recipes.exit import run_and_exit  # no interpreter finalization to abort a finished run

    run_and_exit(main)
