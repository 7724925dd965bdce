"""Byte-level data: a tokenizer with nothing to download, a corpus every machine has, a step-keyed order.

- Tokens are bytes: vocabulary 256, ``encode`` is UTF-8, any file is valid input.
- The default corpus is the Python standard library's own ``.py`` sources (a few MB,
  present wherever Python is), read in sorted order so every machine builds the same
  byte string from the same Python version.
- The batch for (step, data-parallel rank, micro-batch) is drawn from a generator seeded
  by (seed, step, rank, micro-batch) alone. No iterator state: a run resumed at step s
  sees exactly the batches an uninterrupted run would, and checkpoints need no data state.
- Validation holds out the corpus's last bytes (``split_corpus``); training then draws from
  the rest only, validation from them only.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import torch

__all__ = ["ByteTokenizer", "corpus_files", "load_corpus", "corpus_size", "split_corpus", "get_batch"]


class ByteTokenizer:
    """Bytes 0-255 are the tokens."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


def corpus_files(path: str | None = None) -> list[Path]:
    """The files that make up the corpus, in a fixed order.

    Args:
        path: a file, or a directory whose files (recursively, hidden ones skipped) are all
            read; ``None`` for the standard library's top-level ``*.py`` files.
    """
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(root.glob("*.py"))
        if not files:
            raise FileNotFoundError(f"no .py files in the standard library directory {root}; pass --data PATH")
        return files
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"--data {path}: no such file or directory")
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not files:
        raise FileNotFoundError(f"--data {path}: the directory holds no files")
    return files


def corpus_size(path: str | None = None) -> int:
    """Bytes :func:`load_corpus` returns, from the files' sizes (nothing read)."""
    files = corpus_files(path)
    return sum(f.stat().st_size for f in files) + len(files) - 1


def split_corpus(corpus: torch.Tensor, held_out: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(training part, held-out part): the last ``held_out`` fraction of the bytes is held out.

    The tail, not random windows: a window drawn from one part never overlaps the other.
    """
    n_held_out = int(corpus.numel() * held_out)
    return corpus[: corpus.numel() - n_held_out], corpus[corpus.numel() - n_held_out:]


def load_corpus(path: str | None = None) -> torch.Tensor:
    """All corpus files' bytes joined by newlines, as a uint8 tensor of tokens."""
    data = b"\n".join(f.read_bytes() for f in corpus_files(path))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def get_batch(
    corpus: torch.Tensor, *, seed: int, step: int, rank: int, micro: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch_size, seq_len) int64: random windows, targets shifted by one.

    A pure function of its arguments; ``rank`` is the data-parallel rank (ranks of one
    tensor-parallel group pass the same one).
    """
    if corpus.numel() <= seq_len + 1:
        raise ValueError(f"the corpus has {corpus.numel()} tokens, fewer than seq_len + 2 = {seq_len + 2}")
    key = hashlib.blake2b(f"{seed}/{step}/{rank}/{micro}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") & (2**63 - 1))
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch_size,), generator=gen)
    windows = torch.stack([corpus[s : s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]  # (batch, seq) each
