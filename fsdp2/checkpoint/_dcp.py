"""``save`` / ``load``: model, optimizer and extra state through torch.distributed.checkpoint, atomically.

A save writes a DCP checkpoint into ``<path>.tmp-<id>``; once every rank has
finished (DCP's own final gather, then a barrier) rank 0 writes the completion
marker into it and renames it to ``path``, moving a previous checkpoint aside
first and deleting it last. A save interrupted at any point leaves either the
previous complete checkpoint at ``path`` or, in the instant between the two
renames, at ``<path>.old-<id>``, which :func:`load` falls back to. A directory
without the marker is never loaded.

The marker also lists every file of the checkpoint with its size and its CRC-32 (summed as
the save wrote the bytes, see ``_checksum.py``), so :func:`verify` (and :func:`load`, before
DCP reads anything) tells a complete checkpoint from one damaged afterwards: a truncated
copy, a deleted shard, a full disk during a copy (a few ``stat`` calls and DCP's small
``.metadata`` file), and bytes overwritten in place (reading each file once; :func:`load`
spreads the files over the ranks).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)

from .. import _compat, _wire
from ._checksum import ChecksummingFileSystem, crc32_of_file
from ._meta import materialize

__all__ = ["MARKER", "CorruptCheckpointError", "save", "load", "verify", "verify_on_ranks", "find_complete",
           "single_process_ok"]

logger = logging.getLogger(__name__)

MARKER = "fsdp2_complete.json"
"""Written last, by rank 0, into a checkpoint directory every rank finished writing."""

_MARKER_VERSION = 3  # 3: adds "crc32" (name -> CRC-32); 2: adds "files" (name -> size) and "bytes"; 1 had neither


class CorruptCheckpointError(RuntimeError):
    """A checkpoint directory whose completion marker exists but whose files do not match it.

    The message names the directory and every missing, truncated or unreadable file;
    ``problems`` holds them as a list.
    """

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path, self.problems = path, problems
        super().__init__(f"checkpoint {path} is corrupted: " + "; ".join(problems)
                         + ". Load an older checkpoint, or save again from a good one")


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, Any] | None = None, *, flat_optimizer: bool = False) -> None:
    """Save ``model`` (and ``optimizer``, and ``extra``) as a sharded DCP checkpoint at ``path``.

    Every rank writes only its own shards (no gather); ``extra`` (step counters,
    RNG states: anything ``torch.load(weights_only=True)`` reads back) is
    written once. Call it on every rank with the same ``path``; the directory
    must be on a filesystem every rank sees. Replaces a previous checkpoint at
    ``path`` only once the new one is complete.

    Args:
        path: the checkpoint directory.
        model: the (sharded or plain) model.
        optimizer: its optimizer, or ``None`` to save the model only.
        extra: small picklable state returned by :func:`load`.
        flat_optimizer: store the optimizer's state and hyperparameters under each parameter's
            name (``StateDictOptions(flatten_optimizer_state_dict=True)``), not as one list of
            parameter groups. Needed where ranks hold different parameters (pipeline stages):
            each rank's groups name other parameters, and DCP would keep one rank's list. The
            marker records it; :func:`load` reads either.
    """
    path = Path(path)
    distributed = dist.is_available() and dist.is_initialized()
    tmp, token = prepare(path)
    state = state_of(model, optimizer, extra, flat_optimizer)
    writer = dcp.FileSystemWriter(str(tmp))
    summing = _compat.wrap_dcp_writer_files(writer, lambda fs: ChecksummingFileSystem(fs, tmp))
    with single_process_ok():
        dcp.save(state, storage_writer=writer, no_dist=not distributed)
    finalize(path, tmp, token, summing.sums if summing is not None else {},
             {"optimizer": optimizer is not None, "flat_optimizer": flat_optimizer, "extra": extra is not None})


def prepare(path: Path) -> tuple[Path, str]:
    """Collective (default group): refuse to replace a foreign directory; (the temporary directory, its id)."""
    if path.exists() and not (path / MARKER).is_file():
        raise FileExistsError(f"fsdp2.checkpoint.save: {path} exists and is not an fsdp2 checkpoint; "
                              "refusing to replace it (pick another path or remove it)")
    token = uuid.uuid4().hex[:12]
    if dist.is_available() and dist.is_initialized():
        token = _wire.broadcast_json(token)  # every rank writes into the same directory
    return path.with_name(f"{path.name}.tmp-{token}"), token


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None,
             flat_optimizer: bool) -> dict[str, Any]:
    """The dictionary DCP saves: the model's (and optimizer's) state dict, ``extra`` as one blob."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_optim_options(flat_optimizer))
    if extra is not None:
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        state["extra"] = buffer  # one opaque blob: DCP would flatten a dict into keys
    return state


def finalize(path: Path, tmp: Path, token: str, sums: dict[str, int | None], saved: dict[str, bool],
             pg: dist.ProcessGroup | None = None) -> None:
    """Collective over ``pg``, once this rank's files in ``tmp`` are written: the marker, then the rename.

    Gathers every rank's checksums (which is also the barrier: every rank's files are closed
    before the marker says so); rank 0 writes the marker and renames ``tmp`` to ``path``; a
    last barrier keeps every rank from returning (and maybe loading) before the rename.
    ``saved``: what the checkpoint holds (``optimizer``, ``flat_optimizer``, ``extra``).
    """
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        sums = {name: crc for each in _wire.all_gather_json(sums, pg) for name, crc in each.items()}
    if not distributed or dist.get_rank() == 0:
        files = _file_sizes(tmp)  # after the gather: every rank's files are complete
        # A file whose bytes went past the running sum (a seek, an older torch): summed by reading it.
        crc = {name: sums[name] if sums.get(name) is not None else crc32_of_file(tmp / name) for name in files}
        marker = {"format": "fsdp2.checkpoint", "version": _MARKER_VERSION, "optimizer": saved["optimizer"],
                  **({"flat_optimizer": True} if saved["flat_optimizer"] else {}),
                  "extra": saved["extra"], "world_size": dist.get_world_size() if distributed else 1,
                  "torch": torch.__version__, "files": files, "bytes": sum(files.values()), "crc32": crc}
        _write_synced(tmp / MARKER, json.dumps(marker, indent=1).encode())
        old = path.with_name(f"{path.name}.old-{token}")
        if path.exists():
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(path.parent)
        # The replaced checkpoint, and leftovers of saves interrupted earlier.
        for stale in [old, *path.parent.glob(f"{path.name}.tmp-*"), *path.parent.glob(f"{path.name}.old-*")]:
            shutil.rmtree(stale, ignore_errors=True)
    if distributed:
        dist.barrier(group=pg)  # nobody returns (and maybe loads) before the rename


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         check_content: bool = True) -> dict[str, Any] | None:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``); return ``extra``.

    Works on any number of ranks and any sharding (DCP reads the slices each
    rank needs), including a plain model in a single process, and a model built
    on the meta device and sharded, never materialized (this rank's shards are
    allocated first; see ``_meta.py``). Before DCP reads anything, the ranks
    check the checkpoint together (:func:`verify_on_ranks`: rank 0 the sizes and
    ``.metadata``, each rank the checksums of its share of the files), so every
    rank raises the same error (none is left waiting in a collective).
    ``check_content=False`` skips the checksums (the cheap checks still run), for a
    caller that has just run :func:`verify_on_ranks` itself.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path`` (a directory
            without the completion marker is an interrupted save).
        CorruptCheckpointError: the marker is there but a file it lists is
            missing, has another size or another checksum, or DCP's
            ``.metadata`` is unreadable or points past the end of a file.
        ValueError: an optimizer was given but the checkpoint has none.
    """
    distributed = dist.is_available() and dist.is_initialized()
    found: Any = None
    if not distributed or dist.get_rank() == 0:
        found = _find(path)
    if distributed:
        found = _wire.broadcast_json(found)
    if found["error"] is not None:
        raise FileNotFoundError(found["error"])
    path = Path(found["path"])
    if problems := verify_on_ranks(path, content=check_content):
        raise CorruptCheckpointError(path, problems)
    marker = json.loads((path / MARKER).read_text())
    if optimizer is not None and not marker["optimizer"]:
        raise ValueError(f"checkpoint {path} was saved without an optimizer; call load(path, model)")
    materialize(model)  # a model built on the meta device: storage for what DCP reads into
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    options = _optim_options(marker.get("flat_optimizer", False))  # as it was saved
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=options)
    if marker["extra"]:
        state["extra"] = io.BytesIO()
    with single_process_ok():
        dcp.load(state, checkpoint_id=str(path), no_dist=not distributed)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=options)
    if not marker["extra"]:
        return None
    state["extra"].seek(0)
    return torch.load(state["extra"], weights_only=True)


def _optim_options(flat: bool) -> StateDictOptions | None:
    return StateDictOptions(flatten_optimizer_state_dict=True) if flat else None


def find_complete(path: str | os.PathLike) -> Path:
    """``path`` if it holds a complete checkpoint, else the one a save was replacing."""
    path = Path(path)
    if (path / MARKER).is_file():
        return path
    for old in sorted(path.parent.glob(f"{path.name}.old-*")):
        if (old / MARKER).is_file():
            logger.warning("fsdp2.checkpoint: %s is incomplete or missing; loading %s, the checkpoint an "
                           "interrupted save was replacing", path, old)
            return old
    why = "has no completion marker (an interrupted or foreign save)" if path.exists() else "does not exist"
    raise FileNotFoundError(f"no complete fsdp2 checkpoint at {path}: the directory {why}")


def verify(path: str | os.PathLike, *, content: bool = True) -> list[str]:
    """The problems that make ``path`` unusable as a checkpoint; an empty list if it is sound.

    The completion marker must be there and parse; every file it lists must exist with the
    size it recorded; DCP's ``.metadata`` must unpickle and every byte range it points to
    must lie inside an existing file (a few ``stat`` calls and one small read). With
    ``content`` (the default), every file's CRC-32 must also equal the one the save recorded
    as it wrote the bytes, which reads the whole checkpoint once: pass ``content=False`` for
    the cheap checks alone. Checkpoints saved before the marker held sums (version 2) get the
    size checks, before it listed files (version 1) the ``.metadata`` checks only. Local, one
    process, no collective (:func:`load` spreads the content check over the ranks).
    """
    problems, sums = _check_structure(Path(path))
    if problems or not content:
        return problems
    return _check_content(Path(path), sums)


def _check_structure(path: Path) -> tuple[list[str], dict[str, int]]:
    """(what the cheap checks find wrong, the marker's CRC-32 per file: empty for old markers)."""
    if not path.is_dir():
        return [f"{path} does not exist or is not a directory"], {}
    if not (path / MARKER).is_file():
        return [f"{path} has no completion marker {MARKER} (an interrupted or foreign save)"], {}
    try:
        marker = json.loads((path / MARKER).read_text())
        listed = {str(name): int(size) for name, size in marker.get("files", {}).items()}
        sums = {str(name): int(crc) for name, crc in marker.get("crc32", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError) as e:
        return [f"{MARKER} is unreadable ({e})"], {}
    problems: dict[str, str] = {}  # file -> what is wrong with it; one problem per file
    for name, size in sorted(listed.items()):
        actual = _size(path / name)
        if actual is None:
            problems[name] = f"{name} is missing"
        elif actual != size:
            problems[name] = f"{name} is {actual} bytes but was saved with {size} (truncated or overwritten)"
    if ".metadata" not in problems:
        try:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as e:  # a damaged pickle raises anything from EOFError to UnpicklingError
            problems[".metadata"] = f".metadata is unreadable ({type(e).__name__}: {e})"
        else:
            for name, end in _ends(metadata).items():
                if name in problems:
                    continue
                actual = _size(path / name)
                if actual is None:
                    problems[name] = f"{name} is missing (.metadata points into it)"
                elif actual < end:
                    problems[name] = f"{name} is {actual} bytes but .metadata needs {end} (truncated)"
    return list(problems.values()), sums


def _check_content(path: Path, sums: dict[str, int]) -> list[str]:
    """What differs from the CRC-32 the save recorded, for each file in ``sums`` (reads them all).

    Files are summed on a few threads: zlib releases the GIL while it sums, so a process
    checking many files (the ``verify`` command) uses as many cores.
    """
    def problem(name: str, want: int) -> str | None:
        try:
            got = crc32_of_file(path / name)
        except OSError as e:
            return f"{name} is unreadable ({e})"
        if got == want:
            return None
        return f"{name} does not match its checksum (CRC-32 {got:08x}, saved as {want:08x}): overwritten or " \
               "corrupted after the save"

    items = sorted(sums.items())
    if len(items) <= 1:
        found = [problem(name, want) for name, want in items]
    else:
        with ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1, 8)) as pool:
            found = list(pool.map(lambda item: problem(*item), items))
    return [p for p in found if p is not None]


def verify_on_ranks(path: str | os.PathLike, *, content: bool = True) -> list[str]:
    """Collective :func:`verify`: the same list on every rank, each rank reading its share of the files.

    Rank 0 runs the cheap checks and broadcasts them; when they pass, rank ``r`` checks the
    sums of files ``r``, ``r + world``, ... (DCP writes one file per rank, so each rank reads
    about one file) and every rank gets all the findings. ``content=False``: the cheap checks
    only. Without a process group: :func:`verify`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return verify(path, content=content)
    checked = _check_structure(Path(path)) if dist.get_rank() == 0 else None
    problems, sums = _wire.broadcast_json(checked)
    if problems or not content:
        return problems
    mine = dict(sorted(sums.items())[dist.get_rank()::dist.get_world_size()])
    return sorted(p for found in _wire.all_gather_json(_check_content(Path(path), mine)) for p in found)


def _ends(metadata: Any) -> dict[str, int]:
    """File -> the end of the last byte range DCP's index points to in it."""
    ends: dict[str, int] = {}
    # storage_data maps each tensor chunk to (relative_path, offset, length) for the filesystem
    # storage; other storages keep other things there, which have nothing to check.
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        if isinstance(name, str):
            ends[name] = max(ends.get(name, 0), info.offset + info.length)
    return dict(sorted(ends.items()))


def _size(file: Path) -> int | None:
    try:
        return file.stat().st_size if file.is_file() else None
    except OSError:
        return None


def _find(path: str | os.PathLike) -> dict[str, str | None]:
    """The complete checkpoint to load, or why there is none (JSON-serialisable)."""
    try:
        return {"path": str(find_complete(path)), "error": None}
    except FileNotFoundError as e:
        return {"path": None, "error": str(e)}


def _file_sizes(root: Path) -> dict[str, int]:
    """Every file under ``root`` (relative POSIX path) with its size in bytes."""
    return {f.relative_to(root).as_posix(): f.stat().st_size for f in sorted(root.rglob("*")) if f.is_file()}


@contextmanager
def single_process_ok() -> Iterator[None]:
    """Silence DCP's warning that it runs without a process group: here that is on purpose."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
