"""How ``QuantizedComm``'s ``block_size`` trades bytes for accuracy, on the recipe's tiny Llama.

    python benchmarks/quantized_block_size.py                 # one process, about a minute on CPU
    python benchmarks/quantized_block_size.py --world 8 --blocks 64,256,1024

One process, no communication: the quantization is fsdp2's own (``comm/_quantize.py``), applied
to what ``--world`` ranks would send. The model is the recipe's config (default tiny.toml),
trained ``--steps`` AdamW steps on one process so that its weights and gradients are a
trained model's, not an initialisation's. Then, for each block size and for int8 and int4:

- ``weights_error``: the relative error (norm of the difference over the norm) of every
  parameter's shard chunks quantized as the all-gather sends them (rows split over ``--world``
  ranks as ``Chunking.even`` splits them, blocks from each chunk's first element), over the
  whole model;
- ``grads_error``: the same for one step's gradients reduced as ``gradients=`` does on
  ``--world`` ranks, each rank sending the same gradient (so the error is one quantization's);
- ``bytes_ratio``: the packed bytes (values, 16-byte aligned, and 4-byte fp32 scales) over
  the gradients' fp32 bytes.

The JSON line it ends with holds one row per (bits, block).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `recipes` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from fsdp2._format import Chunking
from fsdp2.comm._quantize import GradChunks
from recipes.config import DEFAULT_CONFIG, load_config
from recipes.data import get_batch, load_corpus
from recipes.llama.model import Transformer


def chunks_of(t: torch.Tensor, world: int) -> torch.Tensor:
    """``t``'s ``world`` padded shard chunks as rows, flattened (``(world, chunk numel)``)."""
    lay = Chunking.even(t.shape, 0, world)
    padded = torch.cat([t, t.new_zeros((lay.padded_shape[0] - t.shape[0], *t.shape[1:]))])
    return lay.chunks_view(padded).reshape(world, -1)


def round_trip(rows: torch.Tensor, block: int, bits: int) -> tuple[torch.Tensor, int]:
    """``rows`` quantized per row as one all-to-all row each, dequantized; and the bytes sent."""
    world, numel = rows.shape
    packing = GradChunks(world, numel, block, bits)
    packed = torch.empty(world * packing.chunk_bytes, dtype=torch.uint8)
    packing.quantize(rows, packed)
    return packing.dequantize(packed, torch.float32)[:, :numel], world * packing.chunk_bytes


def measure(tensors: list[torch.Tensor], world: int, block: int, bits: int) -> tuple[float, float]:
    """(relative error over all ``tensors``, packed bytes over fp32 bytes)."""
    err = ref = 0.0
    sent = fp32 = 0
    for t in tensors:
        rows = chunks_of(t.detach().float(), world)
        back, nbytes = round_trip(rows, block, bits)
        err += (back - rows).pow(2).sum().item()
        ref += rows.pow(2).sum().item()
        sent += nbytes
        fp32 += 4 * rows.numel()
    return (err / ref) ** 0.5, sent / fp32


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--world", type=int, default=2, help="ranks the parameters are sharded over (default 2)")
    p.add_argument("--steps", type=int, default=100, help="AdamW steps before measuring (default 100)")
    p.add_argument("--blocks", default="32,64,128,256,512,1024,4096")
    args = p.parse_args(argv)
    config = load_config(args.config)
    t = config.training
    torch.manual_seed(t.seed)
    model = Transformer(config.model)
    model.init_weights(seed=t.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    corpus = load_corpus(config.data.path)
    for step in range(args.steps + 1):
        inputs, targets = get_batch(corpus, seed=t.seed, step=step, rank=0, micro=0, batch_size=t.batch_size,
                                    seq_len=t.seq_len)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        if step < args.steps:  # the last backward's gradients are measured
            opt.step()
            opt.zero_grad()
    weights = [q for q in model.parameters()]
    grads = [q.grad for q in model.parameters()]
    rows = []
    for bits in (8, 4):
        for block in map(int, args.blocks.split(",")):
            w_err, ratio = measure(weights, args.world, block, bits)
            g_err, _ = measure(grads, args.world, block, bits)
            rows.append({"bits": bits, "block": block, "weights_error": round(w_err, 5),
                         "grads_error": round(g_err, 5), "bytes_ratio": round(ratio, 4)})
            print(f"int{bits} block {block:>5}: weights {w_err:.4%}, gradients {g_err:.4%}, "
                  f"{ratio:.4f}x of fp32's bytes", file=sys.stderr)
    print(json.dumps({"config": {"config": Path(args.config).name, "world": args.world, "steps": args.steps,
                                 "loss": round(loss.item(), 4), "torch": torch.__version__}, "rows": rows}))


if __name__ == "__main__":
    main()
