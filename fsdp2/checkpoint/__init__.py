"""Checkpoint helpers for ``fully_shard``-ed models, thin layers over torch.distributed.checkpoint.

- :func:`save` / :func:`load`: resume training (model, optimizer, extra state)
  from a sharded DCP checkpoint, atomically, on any number of ranks.
- :func:`verify`: what is wrong with a checkpoint directory (missing,
  truncated or overwritten files against the sizes and CRC-32 sums its
  completion marker keeps); :func:`verify_on_ranks` does the same on every
  rank, each reading its share; :func:`load` runs it first and raises
  :class:`CorruptCheckpointError`.
- :func:`export_full`: one safetensors (or ``torch.save``) file of the full
  model for inference tools, gathered one parameter at a time.
- :func:`load_full`: start from full pretrained weights (safetensors, single
  file or Hugging Face shards): each rank memory-maps and reads only its rows.
- :func:`load_hf` / :func:`export_hf`: a Hugging Face Llama folder (``config.json`` and
  safetensors) into fsdp2's Llama, each rank reading its own rows, and back out, streamed
  into shards; :func:`model_args_from_hf` builds the model's shape from ``config.json``.
- :class:`Snapshotter`: in-memory snapshots of each rank's shards in a RAM file system
  (``/dev/shm``), double-buffered and checksummed, copied to a rank of another node;
  they outlive a killed process (not the host) and restore in seconds.
- ``python -m fsdp2.checkpoint export DCP_DIR OUT.safetensors``: consolidate a
  DCP checkpoint offline, without a process group; ``... export-hf CHECKPOINT DIR``: the same
  as a Hugging Face folder; ``... verify DIR``: check a
  checkpoint, or every checkpoint of a run's directory, offline.

See docs/checkpointing.md.
"""

from ._async import ASYNC_MODES, AsyncSaver, SaveHandle
from ._dcp import CorruptCheckpointError, load, save, verify, verify_on_ranks
from ._full import export_full, load_full
from ._hf import check_hf_weights, export_hf, hf_config, is_hf_folder, load_hf, model_args_from_hf
from ._snapshot import SnapshotAreaError, SnapshotPlan, Snapshotter, snapshot_area

__all__ = ["save", "load", "AsyncSaver", "SaveHandle", "ASYNC_MODES", "verify", "verify_on_ranks",
           "CorruptCheckpointError", "export_full", "load_full",
           "model_args_from_hf", "hf_config", "check_hf_weights", "load_hf", "export_hf", "is_hf_folder",
           "Snapshotter", "SnapshotPlan", "SnapshotAreaError", "snapshot_area"]
