"""Hugging Face tokenizers and datasets for the recipe: ``--tokenizer`` and ``--data`` beyond bytes.

- A tokenizer is a Hugging Face ``tokenizers`` file (``tokenizer.json``) or a folder holding one
  (what ``save_pretrained`` writes). Its vocabulary size is its largest token id + 1; its
  end-of-sequence token, put between documents, is ``data.eos_token`` when given, else the
  folder's ``tokenizer_config.json`` ``eos_token``, else ``config.json``'s ``eos_token_id``,
  else the first of a few usual names (``</s>``, ``<|endoftext|>``, ...) the vocabulary holds.
- Documents come from JSON Lines (``.jsonl``: one object per line), Parquet files, or a folder
  written by ``datasets.Dataset.save_to_disk`` (Arrow stream files listed in its
  ``state.json``, read with pyarrow alone), each document the row's ``data.text_field``.
  Files are read in sorted order, rows in file order, so every rank packs the same stream.

``tokenizers`` and ``pyarrow`` are the ``hf`` extra (JSON Lines needs neither); a missing one is
a one-line ValueError naming it.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["HF_INSTALL", "require", "HFTokenizer", "load_hf_tokenizer", "read_documents", "arrow_files",
           "STRUCTURED_SUFFIXES"]

HF_INSTALL = "pip install 'fsdp2[hf]' (in a checkout: pip install -e '.[hf]')"
STRUCTURED_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}
# Names an end-of-sequence token goes by, tried in this order when no file of the folder names it.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
CHUNK = 1024  # documents tokenized per call (tokenizers' encode_batch spreads them over threads)


def require(module: str, purpose: str) -> ModuleType:
    """``module`` imported, or a one-line ValueError saying ``purpose`` needs the ``hf`` extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{purpose} needs the {module} package: {HF_INSTALL}") from None


class HFTokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with the end-of-sequence id the recipe packs with.

    ``encode`` adds no special tokens (no BOS): documents are separated by ``eos_id`` alone.
    """

    def __init__(self, tokenizer: Any, eos_id: int, source: str) -> None:
        self._tokenizer = tokenizer
        self.eos_id = eos_id
        self.source = source
        # The largest id + 1: added tokens may sit past the base vocabulary.
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=False)

    def __eq__(self, other: object) -> bool:  # the packed stream's cache: same file and EOS, same tokens
        return isinstance(other, HFTokenizer) and (self.source, self.eos_id) == (other.source, other.eos_id)

    def __hash__(self) -> int:
        return hash((self.source, self.eos_id))

    def __repr__(self) -> str:
        return f"{self.source} (vocabulary {self.vocab_size:,}, EOS id {self.eos_id})"


def load_hf_tokenizer(path: str, eos_token: str | None = None) -> HFTokenizer:
    """The tokenizer of ``path`` (a ``tokenizer.json`` or a folder holding one); ValueError in one line."""
    flag = f"--tokenizer {path}"
    given = Path(path)
    if given.is_dir():
        file, folder = given / "tokenizer.json", given
        if not file.is_file():
            other = [n for n in ("tokenizer.model", "vocab.json") if (given / n).exists()]
            hint = (f" (it has {', '.join(other)}: save the tokenizer with transformers' AutoTokenizer"
                    ".save_pretrained, which writes tokenizer.json)" if other else "")
            raise ValueError(f"{flag}: the folder has no tokenizer.json{hint}")
    elif given.is_file():
        file = given
        folder = given.parent if given.name == "tokenizer.json" else None  # a model folder's siblings count
    else:
        raise ValueError(f"{flag}: no such file or directory")
    Tokenizer = require("tokenizers", "--tokenizer").Tokenizer
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own Exception for a file it cannot parse
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{flag}: {file} is not a Hugging Face tokenizers file ({reason})") from None
    return HFTokenizer(tokenizer, _eos_id(tokenizer, folder, eos_token, flag), str(path))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _eos_id(tokenizer: Any, folder: Path | None, eos_token: str | None, flag: str) -> int:
    """The end-of-sequence id: ``eos_token``'s, else the folder's files', else a usual name's."""
    if eos_token is not None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"data.eos_token={eos_token!r} is not in the vocabulary of {flag}; give one of its "
                             f"tokens (its special ones: {', '.join(_special_tokens(tokenizer)) or 'none'})")
        return eos_id
    if folder is not None:
        named = _read_json(folder / "tokenizer_config.json").get("eos_token")
        if isinstance(named, dict):  # older files: {"content": "</s>", ...}
            named = named.get("content")
        if isinstance(named, str) and (eos_id := tokenizer.token_to_id(named)) is not None:
            return eos_id
        config_id = _read_json(folder / "config.json").get("eos_token_id")
        if isinstance(config_id, list) and config_id:  # several end tokens: the first
            config_id = config_id[0]
        if isinstance(config_id, int) and tokenizer.id_to_token(config_id) is not None:
            return config_id
    for name in EOS_NAMES:
        if (eos_id := tokenizer.token_to_id(name)) is not None:
            return eos_id
    raise ValueError(f"{flag}: cannot tell its end-of-sequence token (no eos_token in tokenizer_config.json, no "
                     f"eos_token_id in config.json, none of {' '.join(EOS_NAMES)} in its vocabulary); name it with "
                     f"--data.eos_token=TOKEN (its special tokens: {', '.join(_special_tokens(tokenizer)) or 'none'})")


def _special_tokens(tokenizer: Any) -> list[str]:
    return [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special][:8]


# ---- documents ------------------------------------------------------------------------------
def read_documents(files: list[Path], fmt: str, field: str, flag: str) -> Iterator[list[str]]:
    """The documents of ``files`` (all of format ``fmt``: jsonl, parquet or arrow), in chunks, in order."""
    reader = {"jsonl": _jsonl, "parquet": _parquet, "arrow": _arrow}[fmt]
    for file in files:
        yield from reader(file, field, flag)


def _jsonl(file: Path, field: str, flag: str) -> Iterator[list[str]]:
    chunk: list[str] = []
    with open(file, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{flag}: {file} line {number} is not JSON ({e})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{flag}: {file} line {number} is not a JSON object; each line must be one")
            if field not in row:
                raise ValueError(f"{flag}: {file} line {number} has no field {field!r} (its fields: "
                                 f"{', '.join(row) or 'none'}); name the text's with --data.text_field=NAME")
            if not isinstance(row[field], str):
                raise ValueError(f"{flag}: {file} line {number}: field {field!r} holds a "
                                 f"{type(row[field]).__name__}, not text; name the text's with --data.text_field")
            chunk.append(row[field])
            if len(chunk) == CHUNK:
                yield chunk
                chunk = []
    if chunk:
        yield chunk


def _text_column(schema: Any, field: str, file: Path, flag: str) -> None:
    """Raise ValueError unless the Arrow ``schema`` has a string column ``field``."""
    pa = require("pyarrow", f"{flag} ({file.suffix} files)")
    if field not in schema.names:
        raise ValueError(f"{flag}: {file} has no field {field!r} (its fields: {', '.join(schema.names) or 'none'}); "
                         "name the text's with --data.text_field=NAME")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"):
        raise ValueError(f"{flag}: {file}: field {field!r} holds {kind}, not text; name the text's with "
                         "--data.text_field=NAME")


def _strings(column: Any, file: Path, field: str, flag: str) -> list[str]:
    values = column.to_pylist()
    if None in values:
        raise ValueError(f"{flag}: {file}: field {field!r} is empty (null) in some rows; drop them or fill them")
    return values


def _parquet(file: Path, field: str, flag: str) -> Iterator[list[str]]:
    require("pyarrow", f"{flag} (.parquet files)")
    import pyarrow.parquet as pq
    try:
        parquet = pq.ParquetFile(file)
    except Exception as e:  # pyarrow's ArrowInvalid and friends
        raise ValueError(f"{flag}: {file} is not a Parquet file ({str(e).splitlines()[0]})") from None
    _text_column(parquet.schema_arrow, field, file, flag)
    for batch in parquet.iter_batches(batch_size=CHUNK, columns=[field]):
        yield _strings(batch.column(0), file, field, flag)


def _arrow(file: Path, field: str, flag: str) -> Iterator[list[str]]:
    pa = require("pyarrow", f"{flag} (a datasets folder)")
    try:
        reader = pa.ipc.open_stream(pa.memory_map(str(file)))
    except Exception as e:
        raise ValueError(f"{flag}: {file} is not an Arrow stream file ({str(e).splitlines()[0]})") from None
    _text_column(reader.schema, field, file, flag)
    for batch in reader:
        yield _strings(batch.column(field), file, field, flag)


def arrow_files(folder: Path, flag: str) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder, in the order its ``state.json`` lists them."""
    names = [entry.get("filename") for entry in _read_json(folder / "state.json").get("_data_files", [])
             if isinstance(entry, dict)]
    files = [folder / n for n in names if n]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"{flag}: state.json lists no Arrow files that exist here; is this a folder written by "
                         "datasets' save_to_disk?")
    return files
