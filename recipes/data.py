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
- With ``--tokenizer`` (a Hugging Face ``tokenizer.json``) or structured ``--data`` (JSON Lines,
  Parquet, a ``datasets`` folder; ``recipes/hf_data.py``), the documents are tokenized in a fixed
  order and packed into one stream, the end-of-sequence token between documents; the byte
  tokenizer's separator is the newline, so the default corpus is the same bytes either way.
  The packed stream is kept (``functools.lru_cache``) for the process: the pre-flight check
  tokenizes it and training reuses it, once per rank.
"""

from __future__ import annotations

import array
import functools
import hashlib
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .hf_data import STRUCTURED_SUFFIXES, HFTokenizer, arrow_files, load_hf_tokenizer, read_documents

if TYPE_CHECKING:
    from .config import DataConfig

__all__ = ["ByteTokenizer", "HFTokenizer", "load_tokenizer", "tokenizer_vocab_size", "data_format", "corpus_files",
           "load_corpus", "load_data", "corpus_size", "corpus_length", "corpus_unit", "describe_data", "split_corpus",
           "get_batch"]


class ByteTokenizer:
    """Bytes 0-255 are the tokens; documents (files) are separated by a newline."""

    vocab_size = 256
    eos_id = 10  # "\n": what the corpus's files have always been joined with

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[bytes]:
        return [t.encode("utf-8") for t in texts]

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def __eq__(self, other: object) -> bool:  # all alike: one cache entry for the packed stream
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)

    def __repr__(self) -> str:
        return "bytes (vocabulary 256)"


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None, *, eos_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """``--tokenizer``: None for bytes, else a ``tokenizer.json`` or a folder holding one (``recipes/hf_data.py``).

    Raises a one-line ValueError for a missing path, an unreadable file, no end-of-sequence
    token, or the ``hf`` extra missing.
    """
    return ByteTokenizer() if path is None else load_hf_tokenizer(path, eos_token)


def tokenizer_vocab_size(path: str | None, *, eos_token: str | None = None) -> int:
    """Token ids ``path``'s tokenizer produces (its largest + 1): the least ``model.vocab_size`` that fits.

    For a Hugging Face model folder used both as ``--tokenizer`` and as the initial weights, its
    ``config.json`` ``vocab_size`` must be at least this.
    """
    return load_tokenizer(path, eos_token=eos_token).vocab_size


def data_format(path: str | None) -> str:
    """``--data``'s kind: ``text`` (files read whole), ``jsonl``, ``parquet`` or ``arrow`` (a ``datasets`` folder)."""
    if path is None:
        return "text"
    root = Path(path)
    if root.is_dir():
        if (root / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
            raise ValueError(f"--data {path}: a DatasetDict folder (splits: {', '.join(splits) or 'none'}); give one "
                             f"split's folder, e.g. --data {root / (splits[0] if splits else 'train')}")
        if (root / "state.json").is_file() and any(root.glob("*.arrow")):
            return "arrow"
        suffixes = {f.suffix for f in corpus_files(path)}
        if not suffixes & set(STRUCTURED_SUFFIXES):
            return "text"
        if len(suffixes) > 1:
            raise ValueError(f"--data {path}: the folder mixes {', '.join(sorted(suffixes))} files; give a folder "
                             "of .jsonl files, of .parquet files, or of text files")
        return STRUCTURED_SUFFIXES[suffixes.pop()]
    return STRUCTURED_SUFFIXES.get(root.suffix, "text")


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
    """(training part, held-out part): the last ``held_out`` fraction of the tokens is held out.

    The tail, not random windows: a window drawn from one part never overlaps the other.
    """
    n_held_out = int(corpus.numel() * held_out)
    return corpus[: corpus.numel() - n_held_out], corpus[corpus.numel() - n_held_out:]


def load_corpus(path: str | None = None, tokenizer: ByteTokenizer | HFTokenizer | None = None, *,
                text_field: str = "text") -> torch.Tensor:
    """The corpus as one stream of tokens, the tokenizer's end-of-sequence id between documents.

    Bytes of text files (the default): all files' bytes joined by newlines, a uint8 tensor.
    Otherwise each document (a text file, or a row's ``text_field``) is tokenized, in order;
    uint8 for vocabularies of 256, else int32. Raises a one-line ValueError for bad data.
    """
    tokenizer = tokenizer or ByteTokenizer()
    fmt = data_format(path)
    files = corpus_files(path) if fmt != "arrow" else arrow_files(Path(path), f"--data {path}")
    if fmt == "text" and isinstance(tokenizer, ByteTokenizer):
        data = b"\n".join(f.read_bytes() for f in files)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)  # a changed file: read again
    return _packed(stamp, fmt, tokenizer, text_field, f"--data {path}")


@functools.lru_cache(maxsize=2)
def _packed(stamp: tuple[tuple[str, int, int], ...], fmt: str, tokenizer: ByteTokenizer | HFTokenizer,
            field: str, flag: str) -> torch.Tensor:
    files = [Path(name) for name, _size, _mtime in stamp]
    if fmt == "text":
        chunks = ([f.read_text(encoding="utf-8", errors="replace")] for f in files)
    else:
        chunks = read_documents(files, fmt, field, flag)
    out = array.array("B" if tokenizer.vocab_size <= 256 else "i")
    first = True
    for chunk in chunks:
        for ids in tokenizer.encode_batch(chunk):
            if not first:
                out.append(tokenizer.eos_id)
            out.extend(ids)
            first = False
    if not out:
        return torch.zeros(0, dtype=torch.uint8 if out.typecode == "B" else torch.int32)
    return torch.frombuffer(out, dtype=torch.uint8 if out.typecode == "B" else torch.int32)


def load_data(data: DataConfig) -> torch.Tensor:
    """:func:`load_corpus` for a run's ``[data]`` settings."""
    return load_corpus(data.path, load_tokenizer(data.tokenizer, eos_token=data.eos_token),
                       text_field=data.text_field)


def _bytes_only(data: DataConfig) -> bool:
    return data.tokenizer is None and data_format(data.path) == "text"


def corpus_unit(data: DataConfig) -> str:
    """What :func:`corpus_length` counts: "bytes" (text files, byte tokenizer) or "tokens"."""
    return "bytes" if _bytes_only(data) else "tokens"


def corpus_length(data: DataConfig) -> int:
    """Tokens of the run's corpus: for bytes of text files from the files' sizes, else packed (and kept)."""
    return corpus_size(data.path) if _bytes_only(data) else load_data(data).numel()


def describe_data(data: DataConfig, n_tokens: int) -> str:
    """The setup line about the data: files, tokens, where from, the tokenizer."""
    fmt = data_format(data.path)
    n_files = len(arrow_files(Path(data.path), "") if fmt == "arrow" else corpus_files(data.path))
    where = data.path or "the Python standard library"
    if _bytes_only(data):
        return f"data: {n_files} file{'s' * (n_files != 1)}, {n_tokens:,} bytes from {where}"
    kind = "" if fmt == "text" else f" ({fmt}, field {data.text_field!r})"
    tokenizer = load_tokenizer(data.tokenizer, eos_token=data.eos_token)
    return (f"data: {n_files} file{'s' * (n_files != 1)}{kind}, {n_tokens:,} tokens from {where}; "
            f"tokenizer {tokenizer!r}")


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
