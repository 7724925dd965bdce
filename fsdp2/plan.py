"""``python -m fsdp2.plan``: will a Llama-3-style model fit on a layout, before launch.

    python -m fsdp2.plan --config llama3_70b --world 64 --tp 8 --param-dtype bf16 --gpu-memory 80GiB
    python -m fsdp2.plan --config llama3_8b --world 8 --compare

Builds two blocks of the recipe's Llama (``fsdp2.models.llama``) on fake tensors (no memory;
with ``--tp``, on a fake process group), simulates a training step with fsdp2's buffer
schedule and extrapolates to the config's blocks; see docs/memory.md.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from .memory import Layout, MemoryEstimate, ModelBuilder, estimate_memory
from .models.llama import LLAMA3
from .memory._tracker import format_bytes, format_table

__all__ = ["main", "parse_bytes"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '1024' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"cannot read {text!r} as a size; write e.g. 80GiB or 80GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _bool(text: str) -> bool:
    if text.lower() in ("true", "1", "yes", "on"):
        return True
    if text.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fsdp2.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, choices=sorted(LLAMA3))
    p.add_argument("--world", required=True, type=_positive, help="total ranks")
    p.add_argument("--dp-replicate", type=_positive, default=1)
    p.add_argument("--tp", type=_positive, default=1)
    p.add_argument("--batch", type=_positive, default=1, help="sequences per data-parallel rank")
    p.add_argument("--seq", type=_positive, default=8192)
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--reshard-after-forward", type=_bool, default=True)
    p.add_argument("--activation-checkpointing", type=_bool, default=False)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "sgd_momentum"])
    p.add_argument("--gpu-memory", type=parse_bytes, default=None, help="e.g. 80GiB")
    p.add_argument("--compare", action="store_true", help="one row per candidate layout, by peak")
    return p


def _layout(args: argparse.Namespace, **fields: object) -> Layout:
    """The flags' layout; ``fields`` override some (``--compare`` ignores the flags' mesh and policies)."""
    flags = dict(world=args.world, batch=args.batch, seq=args.seq, dp_replicate=args.dp_replicate, tp=args.tp,
                 param_dtype=DTYPES[args.param_dtype], reduce_dtype=DTYPES[args.reduce_dtype],
                 reshard_after_forward=args.reshard_after_forward,
                 activation_checkpointing=args.activation_checkpointing, optimizer=args.optimizer)
    return Layout(**{**flags, **fields})


def _estimate(args: argparse.Namespace, layout: Layout) -> MemoryEstimate:
    """The recipe's Llama of ``--config`` (two blocks built, the rest extrapolated) on ``layout``."""
    return estimate_memory(layout, ModelBuilder.llama(args.config), gpu_memory=args.gpu_memory)


def _candidates(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(name, dp_replicate, tp) for FSDP, HSDP and FSDP x TP layouts that divide the world."""
    shape, world = LLAMA3[args.config], args.world
    out = [("FSDP", 1, 1)]
    for r in (2, 4, 8):
        if world % r == 0 and world // r > 1:
            out.append((f"HSDP {r}x{world // r}", r, 1))
    for t in (2, 4, 8):
        if world % t == 0 and shape.kv_heads % t == 0 and world // t >= 1:
            out.append((f"FSDP x TP{t}", 1, t))
    return out


def _compare(args: argparse.Namespace) -> str:
    rows = []
    for name, r, t in _candidates(args):
        for reshard in (True, False):
            for ac in (False, True):
                est = _estimate(args, _layout(args, dp_replicate=r, tp=t, reshard_after_forward=reshard,
                                              activation_checkpointing=ac))
                rows.append((est.peak_bytes, (name, "on" if reshard else "off", "on" if ac else "off",
                             format_bytes(est.peak_bytes), est.peak_point, format_bytes(est.comm_bytes_per_step),
                             "-" if est.fits is None else "yes" if est.fits else "no")))
    rows.sort(key=lambda row: row[0])
    header = ("layout", "reshard", "AC", "peak/rank", "peak at", "comm/step/rank", "fits")
    return format_table([r for _, r in rows], header)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.seq > LLAMA3[args.config].max_seq_len:
        _parser().error(f"--seq {args.seq} exceeds the config's max_seq_len {LLAMA3[args.config].max_seq_len}")
    try:
        if args.compare:
            print(f"{args.config}, world {args.world}, batch {args.batch} x seq {args.seq}, "
                  f"param {args.param_dtype}, optimizer {args.optimizer}")
            print(_compare(args))
        else:
            est = _estimate(args, _layout(args))
            print(f"{args.config}: {est.table()}")
            for note in est.notes:
                print(f"note: {note}")
    except ValueError as e:
        print(f"python -m fsdp2.plan: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
