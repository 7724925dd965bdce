"""Typed recipe configuration: dataclasses, a TOML file, and ``--section.key=value`` overrides.

A run's configuration is the dataclass defaults, then the TOML file (``--config``,
default ``configs/tiny.toml``), then command-line overrides, last one wins. Every key
is checked against its dataclass field and converted to the field's type, so a typo or
a wrong type fails before any process group starts, with a message naming the key::

    --training.lrr=1e-3      unknown key 'training.lrr' (from --training.lrr=1e-3); did you mean 'training.lr'?
    --training.steps=ten     training.steps must be an int, got 'ten' (from --training.steps=ten)

A few frequent keys have short flags (``--dp-shard 2`` is ``--parallelism.dp_shard=2``).
Each field's trailing comment (continued on comment lines below it) is its ``--help`` text.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import io
import json
import textwrap
import tokenize
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError
from .llama.model import ModelArgs
from .pipeline_layout import check_pipeline

__all__ = [
    "ConfigError", "JobConfig", "JobSettings", "TrainingConfig", "ParallelismConfig", "DataConfig",
    "ValidationConfig", "CheckpointConfig", "MetricsConfig", "ProfilingConfig", "FaultsConfig", "DEFAULT_CONFIG",
    "parse_args", "load_config", "describe", "field_help", "command_line_keys", "read_layout", "check_layout_world",
]

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny.toml"


def _positive(section: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0 or (value == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise ConfigError(f"{section}.{name} must be {bound}, got {value!r}")


@dataclass
class JobSettings:
    dump_folder: str = "runs"  # the run's directory: profiler traces, memory snapshots and TensorBoard events
    # go in its profile_traces/, memory_snapshot/ and tb/ folders
    dry_run: bool = False  # --dry-run: check everything up to the first step (config, paths, the memory
    # planner's verdict, mesh, data, checkpoint directory), print the plan and stop before allocating the model
    skip_memory_check: bool = False  # --skip-memory-check: start even when the memory planner says this
    # model and layout do not fit the device (the check runs before any rank allocates the model)


@dataclass
class TrainingConfig:
    steps: int = 300  # optimizer steps in the whole run (the LR schedule spans them)
    batch_size: int = 8  # sequences per data-parallel rank per micro-batch
    seq_len: int = 128  # tokens per sequence (bytes, with the byte-level tokenizer)
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 20  # linear warmup from lr / warmup_steps to lr over these steps, then cosine decay
    weight_decay: float = 0.1  # applied to matrices only, not to norms
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    max_grad_norm: float = 1.0  # clip the global gradient norm to this; 0 disables clipping
    mixed_precision: Literal["fp32", "bf16"] = "fp32"  # bf16: compute and all-gather in bf16, reduce in fp32
    activation_checkpoint: bool = False  # recompute each block's activations in backward
    compile: bool = False  # torch.compile each block
    seed: int = 0  # initial weights and data order
    max_skipped_steps: int = 10  # stop once this many steps in a row had a non-finite grad norm; 0: never

    def __post_init__(self) -> None:
        _positive("training", self, "steps", "batch_size", "seq_len", "grad_accum", "lr")
        _positive("training", self, "warmup_steps", "weight_decay", "max_grad_norm", "max_skipped_steps",
                  allow_zero=True)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"training.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")


@dataclass
class ParallelismConfig:
    dp_replicate: int = 1  # replicas (HSDP: each replica is a full FSDP group)
    dp_shard: int = -1  # ranks that shard the parameters (FSDP); -1 = world size / (others)
    tp: int = 1  # tensor-parallel degree
    ep: int = 1  # expert-parallel degree (MoE models): experts split over ep of the dp_shard ranks, tokens sent
    # to them by all-to-all; the experts are FSDP-sharded over dp_shard / ep (docs/recipes.md, mixture of experts)
    pp: int = 1  # pipeline-parallel degree: the blocks are split into stages over these ranks (torch >= 2.13)
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                         "DualPipeV"] = "1F1B"  # torch.distributed.pipelining's schedule; the last four
    # run several stages per pipeline rank (the ZBV and DualPipeV schedules exactly 2, in a V)
    pp_microbatches: int = 0  # microbatches each training.batch_size is split into; 0: one per stage
    pp_layers_per_stage: int = 0  # blocks per stage (torchtitan's pipeline_parallel_layers_per_stage);
    # 0: n_layers / pp stages for GPipe and 1F1B, n_layers / (2 pp) for the multi-stage schedules
    reshard_after_forward: Literal["default", "always", "never"] | int = "default"  # default: all but the root
    # (with pp > 1: none, as torchtitan: every microbatch's forward would gather again); an int N (e.g. 8,
    # the GPUs of a node): each block keeps 1/N of its parameters after forward, so backward gathers them
    # over N ranks only (N must divide dp_shard; not with tp, ep or quantize_weights), the root as default
    quantize_weights: Literal["", "int8", "int4"] = ""  # int8/int4: all-gather the parameters as 8- or
    # 4-bit values with one fp32 scale per quantize_block_size elements (fsdp2.QuantizedComm(weights=...));
    # "": in param_dtype
    quantize_gradients: Literal["", "int8", "int4"] = ""  # int8/int4: reduce the gradients as a quantized
    # all-to-all (fsdp2.QuantizedComm(gradients=...)); "": reduce-scatter in fp32
    quantize_block_size: int = 256  # elements per fp32 scale of the quantized weights and gradients
    quantize_error_feedback: bool = False  # carry each rank's gradient quantization error into the next
    # step (needs quantize_gradients; 4 bytes per parameter element, unsharded, on every rank)
    quantize_gradient_axes: Literal["shard", "replicate", "both"] = "shard"  # with HSDP, which reductions
    # are quantized: the shard axis' reduce-scatter, the replicas' all-reduce (usually between nodes), or both

    def __post_init__(self) -> None:
        _positive("parallelism", self, "quantize_block_size", "ep", "pp")
        _positive("parallelism", self, "pp_microbatches", "pp_layers_per_stage", allow_zero=True)
        if isinstance(self.reshard_after_forward, int) and self.reshard_after_forward < 1:
            raise ConfigError(f"parallelism.reshard_after_forward={self.reshard_after_forward}: an int is the ranks "
                              "each block reshards to after forward (e.g. 8, the GPUs of a node) and must be > 0; "
                              "or use default, always or never")
        if self.quantize_error_feedback and not self.quantize_gradients:
            raise ConfigError("parallelism.quantize_error_feedback needs parallelism.quantize_gradients=int8 or int4 "
                              "(it corrects the gradients' quantization error); set it or leave "
                              "quantize_error_feedback=false")
        if self.quantize_gradient_axes != "shard" and not self.quantize_gradients:
            raise ConfigError(f"parallelism.quantize_gradient_axes={self.quantize_gradient_axes} needs "
                              "parallelism.quantize_gradients=int8 or int4; set it or leave "
                              "quantize_gradient_axes=shard")
        if self.quantize_gradient_axes != "shard" and self.dp_replicate == 1:
            raise ConfigError(f"parallelism.quantize_gradient_axes={self.quantize_gradient_axes} quantizes the "
                              "all-reduce across replicas, and dp_replicate=1 has none; use --dp-replicate 2 or more "
                              "(HSDP), or quantize_gradient_axes=shard")


@dataclass
class DataConfig:
    path: str | None = None  # a text file or a directory of them; .jsonl or .parquet files (or a directory of
    # them) or a folder written by datasets' save_to_disk, one document per row; None: the Python standard
    # library's sources
    tokenizer: str | None = None  # --tokenizer: a Hugging Face tokenizer.json or a model folder holding one
    # (pip install 'fsdp2[hf]'); model.vocab_size follows it unless the command line sets it (not smaller);
    # None: bytes, vocabulary 256
    text_field: str = "text"  # the field of each .jsonl, .parquet or datasets row that holds its document
    eos_token: str | None = None  # the token between documents (e.g. "</s>"); None: the tokenizer's own (its
    # folder's tokenizer_config.json or config.json, or a usual name); bytes: a newline


@dataclass
class ValidationConfig:
    enable: bool = False  # hold out the data's last bytes and report the loss on them; training never
    # sees them (so enabling it changes the training batches)
    split: float = 0.05  # the fraction of the data held out
    freq: int = 50  # validate every N steps, and after the last step
    steps: int = 4  # batches per validation (training.batch_size x training.seq_len per data-parallel
    # rank), the same batches every time

    def __post_init__(self) -> None:
        _positive("validation", self, "freq", "steps")
        if not 0.0 < self.split < 1.0:
            raise ConfigError(f"validation.split must be in (0, 1), got {self.split!r}")


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: no checkpoints; resumes from the newest complete one found here
    every: int = 0  # save every N steps (and at the end); 0: only at the end
    keep: int = 2  # newest sound checkpoints to keep; 0 keeps all
    start_fresh_if_unusable: bool = False  # dir holds only unusable checkpoints: start from step 0, not stop
    export: str | None = None  # write the final full model here: .safetensors (streamed), else torch.save
    initial_load_path: str | None = None  # a run that does not resume starts from these weights (model only):
    # a .safetensors file (or a directory of them), a DCP checkpoint (a step directory or a run's dir), or a
    # Hugging Face Llama folder (config.json + safetensors: its config.json sets the model's shape)
    export_hf: str | None = None  # write the final model here as a Hugging Face folder (config.json + safetensors)
    export_hf_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the dtype export_hf stores
    snapshot_every: Literal["off", "auto"] | int = "off"  # K: every K steps each rank also keeps its state in
    # host memory (snapshot_dir), which a torchrun restart resumes from when newer than the newest checkpoint;
    # auto: the smallest K whose snapshots cost at most 2% of the step time, measured in the first steps
    snapshot_dir: str = ""  # the snapshots' directory, on a RAM file system; "": /dev/shm/fsdp2-<torchrun's run id>
    snapshot_background: Literal["auto"] | bool = "auto"  # true: only the copy into memory holds the step, the
    # checksum and the peer copy run beside the next steps; false: the step waits for all of it; auto: true on
    # one node (no peer copy), false with peer copies (measured: docs/checkpointing.md)
    async_mode: Literal["off", "async", "pinned"] = "off"  # async: training blocks only while the state is copied
    # to host buffers, written in the background; pinned: those buffers pinned (CUDA only; else as async)

    def __post_init__(self) -> None:
        _positive("checkpoint", self, "every", "keep", allow_zero=True)
        if isinstance(self.snapshot_every, int) and self.snapshot_every < 1:
            raise ConfigError(f"checkpoint.snapshot_every must be an int > 0, auto or off, got {self.snapshot_every!r}")


@dataclass
class MetricsConfig:
    log_every: int = 10  # print (and record) every N steps, plus the first and the last
    file: str | None = None  # one JSON object per logged step; a PNG loss curve is written next to it
    plot: bool = True  # draw that PNG at the end (needs matplotlib)
    sample_tokens: int = 0  # at the end, sample this many bytes after the prompt "def " (temperature 0.8,
    # seeded by training.seed) and print them
    peak_tflops: float = 0.0  # one device's peak TFLOPS in the run's precision, for MFU; 0: MFU not shown
    enable_tensorboard: bool = False  # also write every record to TensorBoard, in job.dump_folder/tb
    # (needs pip install -e '.[tensorboard]')

    def __post_init__(self) -> None:
        _positive("metrics", self, "log_every")
        _positive("metrics", self, "sample_tokens", "peak_tflops", allow_zero=True)


@dataclass
class ProfilingConfig:
    trace_steps: list[int] = field(default_factory=list)  # record these steps with torch.profiler, one
    # Chrome/Perfetto trace per step and rank in job.dump_folder/profile_traces
    memory_snapshot_steps: list[int] = field(default_factory=list)  # a memory snapshot of these steps per rank
    # in job.dump_folder/memory_snapshot: CUDA's allocation history (open it at pytorch.org/memory_viz); on
    # CPU, which keeps none, fsdp2.MemoryTracker's live bytes by category at the step's peak

    def __post_init__(self) -> None:
        for name in ("trace_steps", "memory_snapshot_steps"):
            if any(s <= 0 for s in getattr(self, name)):
                raise ConfigError(f"profiling.{name} must hold steps >= 1, got {getattr(self, name)!r}")


@dataclass
class FaultsConfig:
    """Fault injection, for testing the recipe's guards; leave empty for real runs."""

    nan_loss_at_steps: list[int] = field(default_factory=list)  # multiply the loss by NaN at these steps
    nan_loss_rank: int = -1  # ... on this rank only; -1: on every rank
    kill_after_step: int = 0  # SIGKILL a rank once this step is done (torchrun's first attempt only); 0: never
    kill_rank: int = -1  # ... this rank only; -1: every rank

    def __post_init__(self) -> None:
        if any(s <= 0 for s in self.nan_loss_at_steps):
            raise ConfigError(f"faults.nan_loss_at_steps must hold steps >= 1, got {self.nan_loss_at_steps!r}")
        if self.nan_loss_rank < -1:
            raise ConfigError(f"faults.nan_loss_rank must be a rank or -1 (every rank), got {self.nan_loss_rank!r}")


@dataclass
class JobConfig:
    job: JobSettings = field(default_factory=JobSettings)
    model: ModelArgs = field(default_factory=ModelArgs)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    data: DataConfig = field(default_factory=DataConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def __post_init__(self) -> None:
        if self.training.seq_len > self.model.max_seq_len:
            raise ConfigError(
                f"training.seq_len ({self.training.seq_len}) exceeds model.max_seq_len "
                f"({self.model.max_seq_len}); raise model.max_seq_len or shorten the sequences"
            )
        if self.parallelism.pp > 1:
            check_pipeline(self)


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(JobConfig)[f.name] for f in dataclasses.fields(JobConfig)}

# Short flags for the keys people change most. Each takes its value like any override.
ALIASES = {
    "--dp-shard": "parallelism.dp_shard",
    "--dp-replicate": "parallelism.dp_replicate",
    "--tp": "parallelism.tp",
    "--ep": "parallelism.ep",
    "--pp": "parallelism.pp",
    "--steps": "training.steps",
    "--data": "data.path",
    "--tokenizer": "data.tokenizer",
    "--checkpoint-dir": "checkpoint.dir",
    "--checkpoint-every": "checkpoint.every",
    "--metrics-file": "metrics.file",
    "--dry-run": "job.dry_run",
    "--skip-memory-check": "job.skip_memory_check",
}


# ---- typing: one field's type, and converting a value to it -------------------------------
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s (e.g. 3,5)"
    return {int: "an int", float: "a float", bool: "a bool (true/false)", str: "a string"}.get(tp, str(tp))


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _convert(value: Any, tp: Any, key: str, source: str, *, from_cli: bool) -> Any:
    """``value`` as type ``tp``: a command-line string is parsed, a TOML value must already fit."""

    def bad() -> ConfigError:
        return ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} (from {source})")

    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if type(None) in options and from_cli and value.lower() in ("none", "null"):
            return None
        for option in options:
            if option is not type(None):
                try:
                    return _convert(value, option, key, source, from_cli=from_cli)
                except ConfigError:
                    pass
        raise bad()
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad()
        return value
    if origin is list:
        # TOML gives a list; the command line a comma-separated string ("3,5", "[3, 5]", "" for none).
        items = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()] if from_cli else value
        if not isinstance(items, list):
            raise bad()
        try:
            return [_convert(v, typing.get_args(tp)[0], key, source, from_cli=from_cli) for v in items]
        except ConfigError:
            raise bad() from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli:
            try:
                return int(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli:
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise ConfigError(f"{key} has unsupported type {tp!r}")


def _lookup(key: str, source: str) -> tuple[str, str, Any]:
    """(section, name, type) of a dotted key, or a ConfigError that suggests the nearest key."""
    section, _, name = key.partition(".")
    if section not in SECTIONS or not name:
        close = difflib.get_close_matches(section, SECTIONS, n=1)
        hint = f"; did you mean '{close[0]}.{name}'?" if close and name else ""
        raise ConfigError(
            f"unknown config section '{section}' (from {source}){hint} "
            f"sections: {', '.join(SECTIONS)}; keys are written section.key"
        )
    fields = _field_types(SECTIONS[section])
    if name not in fields:
        close = difflib.get_close_matches(name, fields, n=1)
        hint = f"; did you mean '{section}.{close[0]}'?" if close else ""
        raise ConfigError(
            f"unknown key '{key}' (from {source}){hint} keys in [{section}]: {', '.join(fields)}"
        )
    return section, name, fields[name]


# ---- building a JobConfig ----------------------------------------------------------------
def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """The defaults, updated by the TOML file at ``path`` and then by ``--section.key=value`` overrides."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if path is not None:
        _apply_toml(values, Path(path))
    given: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, raw, source in _split_overrides(overrides):
        section, name, tp = _lookup(key, source)
        values[section][name] = given[section][name] = _convert(raw, tp, key, source, from_cli=True)
    if values["checkpoint"].get("initial_load_path"):  # a Hugging Face folder's config.json sets the model's shape
        from .hf_config import hf_model_values

        values["model"] = hf_model_values(values["checkpoint"]["initial_load_path"], values["model"], given["model"])
    try:
        return JobConfig(**{name: SECTIONS[name](**kv) for name, kv in values.items()})
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:  # ModelArgs validates itself with ValueError
        raise ConfigError(str(e)) from e


def _apply_toml(values: dict[str, dict[str, Any]], path: Path) -> None:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section] table")
        for name, value in table.items():
            key, source = f"{section}.{name}", str(path)
            section_, name_, tp = _lookup(key, source)
            values[section_][name_] = _convert(value, tp, key, source, from_cli=False)


def _split_overrides(args: typing.Sequence[str]) -> list[tuple[str, Any, str]]:
    """``--a.b=v``, ``--a.b v``, a bare ``--a.b`` (true, for bool keys) and the short ALIASES."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(f"unexpected argument {arg!r}; overrides are written --section.key=value")
        flag, eq, raw = arg.partition("=")
        key = ALIASES.get(flag, flag[2:])
        if "." not in key:
            raise ConfigError(
                f"unknown option {flag!r}; overrides are written --section.key=value "
                f"(short flags: {', '.join(ALIASES)}, --config)"
            )
        source = arg
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            if nxt is not None and not nxt.startswith("--"):
                raw, source, i = nxt, f"{arg} {nxt}", i + 1
            else:
                section, name, tp = _lookup(key, arg)
                if tp is not bool:
                    raise ConfigError(f"{arg} needs a value: {key} must be {_type_name(tp)}")
                raw = "true"
        out.append((key, raw, source))
        i += 1
    return out


def _pop_option(args: list[str], flag: str) -> str | None:
    """Remove ``flag VALUE`` or ``flag=VALUE`` from ``args``; its value, or None when absent."""
    for i, arg in enumerate(args):
        if arg == flag or arg.startswith(flag + "="):
            if "=" in arg:
                del args[i]
                return arg.partition("=")[2]
            if i + 1 < len(args):
                value = args[i + 1]
                del args[i:i + 2]
                return value
            raise ConfigError(f"{flag} needs a {'path' if flag == '--config' else 'FILE or FILE:K'}")
    return None


def parse_args(argv: typing.Sequence[str]) -> JobConfig:
    """``[--config PATH] [--layout-from FILE[:K]] [--section.key=value | short flag ...]`` -> JobConfig.

    ``--layout-from``'s layout (``python -m fsdp2.plan --search --search-json FILE``) comes after the
    config file and before the other overrides, which may change it.
    """
    args = list(argv)
    path = Path(_pop_option(args, "--config") or DEFAULT_CONFIG)
    spec = _pop_option(args, "--layout-from")
    planned = read_layout(spec) if spec is not None else None
    if planned is not None:
        args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in planned[1]["recipe"].items()] + args
    config = load_config(path, args)
    if planned is not None:
        _check_planned_model(config, planned[0], spec)
    return config


def read_layout(spec: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the plan, its entry K) of ``--layout-from FILE[:K]`` (K: 0, the fastest layout that fits, by default)."""
    file, colon, index = spec.rpartition(":")
    if not colon or not index.isdigit():
        file, index = spec, "0"
    try:
        plan = json.loads(Path(file).read_text())
        entries = plan["layouts"]
    except OSError as e:
        raise ConfigError(f"--layout-from {spec}: cannot read {file} ({e.strerror or e})") from None
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"--layout-from {spec}: not the JSON of python -m fsdp2.plan --search --search-json "
                          f"{file}") from None
    if not 0 <= int(index) < len(entries):
        raise ConfigError(f"--layout-from {spec}: the plan holds layouts 0-{len(entries) - 1}; give FILE:K with K "
                          "among them (0: the fastest that fits)")
    return plan, entries[int(index)]


# The model's shape the plan and the run must agree on (what the layout's memory and speed depend on).
_SHAPE = ("dim", "n_layers", "n_heads", "kv_heads", "vocab_size", "ffn_hidden", "tie_embeddings", "moe_experts",
          "moe_top_k", "expert_hidden", "moe_shared_experts")


def _check_planned_model(config: JobConfig, plan: dict[str, Any], spec: str) -> None:
    planned = ModelArgs(**plan["model_args"])
    differ = [f"{k} {getattr(config.model, k)} (planned: {getattr(planned, k)})" for k in _SHAPE
              if getattr(config.model, k) != getattr(planned, k)]
    if differ:
        raise ConfigError(f"--layout-from {spec}: the layout was planned for another model ({plan.get('model')}): "
                          f"this run's has {', '.join(differ)}; give the --config (or --model.* keys) the plan "
                          "printed with its recipe flags")


def check_layout_world(argv: typing.Sequence[str], world_size: int) -> None:
    """Raise ConfigError when ``--layout-from``'s layout was planned for another number of ranks."""
    spec = _pop_option(list(argv), "--layout-from")
    if spec is None:
        return
    plan, entry = read_layout(spec)
    if entry["layout"]["world"] != world_size:
        raise ConfigError(f"--layout-from {spec}: the layout was planned for {entry['layout']['world']} ranks and this "
                          f"run has {world_size} (WORLD_SIZE); launch {entry['layout']['world']} ranks or search again "
                          f"with --world {world_size}")


def command_line_keys(argv: typing.Sequence[str]) -> set[str]:
    """The ``section.key`` names ``argv``'s overrides and short flags set (not ``--config``'s file, nor
    ``--layout-from``'s layout)."""
    args = list(argv)
    _pop_option(args, "--config")
    _pop_option(args, "--layout-from")
    return {key for key, _raw, _source in _split_overrides(args)}


def describe(config: JobConfig | None = None) -> str:
    """Every key with its value, its type and what it does, section by section (``--help`` prints this)."""
    config = config or JobConfig()
    lines = []
    for section in SECTIONS:
        obj = getattr(config, section)
        lines.append(f"[{section}]")
        helps = field_help(type(obj))
        for name, tp in _field_types(type(obj)).items():
            value = getattr(obj, name)
            text = ("none" if value is None else str(value).lower() if isinstance(value, bool)
                    else ",".join(map(str, value)) if isinstance(value, list) else str(value))
            lines.append(f"  --{section}.{name}={text}  ({_type_name(tp)})")
            lines += textwrap.wrap(helps.get(name, ""), 96, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """What each field of ``cls`` does: its trailing comment, continued by comment lines below it.

    Read from the class's source, so the comment a reader sees beside a field is the text
    ``--help`` prints. Fields without a comment (or a class whose source is missing) get none.
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    helps: dict[str, list[str]] = {}
    current = None
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string == "def":
            break  # the fields come first
        if tok.type == tokenize.NAME and tok.start[1] == 4 and tokens[i + 1].string == ":":
            current = tok.string
        elif tok.type == tokenize.COMMENT and current is not None:
            helps.setdefault(current, []).append(tok.string.lstrip("#").strip())
    return {name: " ".join(parts) for name, parts in helps.items()}
