"""Every command the documentation shows is run or checked here, as written.

The commands are every line of the ```bash blocks in ``docs/*.md`` and ``README.md``, the
lines of unlabelled blocks that start with a command, the ``$ ...`` lines of ```text blocks
(a command and what it prints), continuation lines joined, ``&&`` chains split, comments and
``VAR=value`` prefixes dropped; and the complete ``python -m fsdp2.plan ...`` commands quoted
inline. A command shown in several places is checked once, named by all of them. Each must be
claimed by one rule of ``RULES``; a command no rule knows fails ``test_every_command_has_a_rule``, so a
new command in the docs needs a check here. What each rule does:

- ``pip install``: every requirement is satisfiable by this checkout (torch versions inside
  pyproject's range, extras pyproject defines). CI installs README's Quickstart line for real.
- ``pytest``: the paths exist and the ``-m`` markers are registered (the suite itself is CI).
- the recipe, under ``torchrun`` or ``python``: torchrun's own parser reads the launcher's
  options (the world size: ``--nnodes`` x ``--nproc-per-node``), then ``recipes.train
  .check_command`` runs everything the recipe checks before any process group starts, for that
  world (keys, values, the layout, packages, paths, the data). ``--help`` runs for real. The
  training runs themselves are tests/tools/test_recipe*.py's and CI's Quickstart.
- ``python -m fsdp2.checkpoint export``: runs for real on a checkpoint made here at the path
  the command names; ``... export-hf``: runs for real on a checkpoint of the recipe's model made
  there (its ``--hf-config`` folder made by ``examples/tiny_hf_llama.py``); ``... verify``: runs
  for real on a run's directory made there;
- ``python examples/tiny_hf_llama.py``: runs for real (it needs transformers); a recipe command
  whose ``--checkpoint.initial_load_path`` names a ``tiny-llama`` folder gets one made by it;
  ``python -m fsdp2.plan``: runs for real.
- the benchmarks: their own parsers read and validate the arguments (the measurements take
  minutes to hours); ``benchmarks/gpu_check.sh`` without a GPU is run by
  tests/comm/test_gpu_check.py (it asks for ``--dry-run``, which CI runs too).
- ``ruff check .``: tests/unit/test_lint.py runs it.
- the SLURM script's shell lines (``head=$(scontrol ...)``, ``export ...``) set variables the
  launch line uses; they are given values here.
"""

from __future__ import annotations

import os

import contextlib
import importlib.util
import io
import json
import re
import shlex
import shutil
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import fsdp2.checkpoint
from fsdp2 import plan
from fsdp2.checkpoint.__main__ import main as checkpoint_main
from recipes import train
from recipes.checks import check_command
from recipes.config import ConfigError

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted(REPO.glob("docs/*.md")) + [REPO / "README.md"]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Values for the shell variables the docs' commands use (the SLURM script's).
SHELL_VARS = {"SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "llama",
              "SLURM_JOB_NODELIST": "node[0-1]", "head": "node0"}
INLINE_PLAN = re.compile(r"`(python -m fsdp2\.plan --[^`]*)`")


@dataclass(frozen=True)
class Command:
    where: str  # page:line
    words: tuple[str, ...]

    def __str__(self) -> str:
        return shlex.join(self.words)


def _expand(word: str) -> str:
    return re.sub(r"\$(\w+)", lambda m: SHELL_VARS[m[1]], word)


def _commands_of(text: str, where: str) -> list[Command]:
    found = []
    for part in re.split(r"\s&&\s", text):
        words = shlex.split(part, comments=True)
        while len(words) > 1 and re.fullmatch(r"[A-Za-z_]\w*=[\w./-]*", words[0]):
            words = words[1:]  # VAR=value before a command: the command is what is checked
        if words:
            found.append(Command(where, tuple(words)))
    return found


def doc_commands() -> list[Command]:
    commands = []
    for page in PAGES:
        name = page.relative_to(REPO)
        lines = page.read_text().splitlines()
        block, pending, start = None, "", 0  # block: the open fence's language
        for number, line in enumerate(lines, 1):
            fence = re.match(r"^\s*```(\w*)\s*$", line)
            if fence:
                block = fence[1] if block is None else None
                continue
            if not pending:
                if block == "text" and line.startswith("$ "):
                    line = line[2:]
                elif block == "" and re.match(r"\s*(python|torchrun|bash) ", line):
                    pass
                elif block not in ("bash", "sh", "shell") or not line.strip() or line.lstrip().startswith("#"):
                    continue
            start = start or number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            commands += _commands_of(pending + line, f"{name}:{start}")
            pending, start = "", 0
        for number, line in enumerate(lines, 1):
            for quoted in INLINE_PLAN.findall(line):
                if "..." not in quoted:
                    commands += _commands_of(quoted, f"{name}:{number}")
    return commands


# ---- the rules ------------------------------------------------------------------------------
def _torch_range() -> SpecifierSet:
    torch_req = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if r.startswith("torch"))
    return torch_req.specifier


def check_pip(cmd: Command, tmp_path: Path) -> None:
    words = list(cmd.words[cmd.words.index("install") + 1:])
    while words:
        word = words.pop(0)
        if word == "-e":
            target = words.pop(0)
            m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
            assert m, f"{cmd.where}: pip install -e {target}: expected . or .[extras]"
            extras = m[1].split(",") if m[1] else []
            missing = set(extras) - set(PYPROJECT["project"]["optional-dependencies"])
            assert not missing, f"{cmd.where}: extras {sorted(missing)} are not in pyproject.toml"
        else:
            req = Requirement(word)
            assert req.name == "torch", f"{cmd.where}: {word}: only torch and this checkout are installed by name"
            version = str(req.specifier).removeprefix("==")
            assert version in _torch_range(), f"{cmd.where}: torch {version} is outside pyproject's {_torch_range()}"


def check_pytest(cmd: Command, tmp_path: Path) -> None:
    words = list(cmd.words[cmd.words.index("pytest") + 1:])
    markers = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    while words:
        word = words.pop(0)
        if word == "-m":
            used = set(re.findall(r"\w+", words.pop(0))) - {"not", "and", "or"}
            assert used <= markers, f"{cmd.where}: markers {sorted(used - markers)} are not registered"
        elif not word.startswith("-"):
            assert (REPO / word.split("::")[0]).exists(), f"{cmd.where}: {word} does not exist"


def _world(launcher: list[str]) -> tuple[int, list[str]]:
    """torchrun's own parser on its options: the world size and the script's arguments."""
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(launcher)
    nodes = int(str(args.nnodes).split(":")[-1])
    return nodes * int(args.nproc_per_node), [args.training_script, *args.training_script_args]


def _script(cmd: Command) -> tuple[int, str, list[str]]:
    """(world size, script, its arguments) of ``torchrun ... S`` or ``python S``."""
    words = [_expand(w) for w in cmd.words]
    if words[0] == "srun":
        words = words[1:]
    if words[0] == "torchrun":
        world, rest = _world(words[1:])
        return world, rest[0], rest[1:]
    assert words[0] == "python", cmd
    return 1, words[1], words[2:]


def _in_a_checkout_copy(tmp_path: Path) -> Path:
    """A working directory where the commands' relative paths resolve as in a checkout: the
    recipe's configs, a user's copy of one, the safetensors file getting-started exports."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    shutil.copy(REPO / "recipes/configs/tiny.toml", tmp_path / "my_config.toml")
    (tmp_path / "runs/tiny").mkdir(parents=True)
    (tmp_path / "runs/tiny/model.safetensors").write_bytes(b"")  # only its existence is checked before training
    return tmp_path


LLAMA_3_8B_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "vocab_size": 128256, "intermediate_size": 14336, "max_position_embeddings": 8192,
                 "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5}


def _user_tokenizer_and_data(args: list[str]) -> None:
    """What a ``--tokenizer`` command names, as a user would have it: a model folder's tokenizer.json
    (with ``</s>``) and ``--data`` as JSON Lines, Parquet or a ``datasets`` folder with the text field."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", "the", "cat", "sat", "on", "a", "mat"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = Path(args[args.index("--tokenizer") + 1].removesuffix("tokenizer.json") or ".")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    field = next((a.partition("=")[2] for a in args if a.startswith("--data.text_field=")), "text")
    docs, data = ["the cat sat on a mat"] * 40, Path(args[args.index("--data") + 1])
    if data.suffix == ".jsonl":
        data.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    elif data.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        pyarrow.parquet.write_table(pyarrow.table({field: docs}), data)
    else:
        import datasets

        datasets.Dataset.from_dict({field: docs}).save_to_disk(data)


def check_recipe(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    world, script, args = _script(cmd)
    assert script == "recipes/train.py"
    monkeypatch.chdir(_in_a_checkout_copy(tmp_path))
    if "--tokenizer" in args:
        _user_tokenizer_and_data(args)
    if "--help" in args:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            train.main(args)
        assert "--training.steps" in out.getvalue()
        return
    for arg in args:  # docs/hf-finetune.md: a Hugging Face model folder its first command makes
        if arg.startswith("--checkpoint.initial_load_path=") and Path(arg.partition("=")[2]).name == "tiny-llama":
            _tiny_hf_llama(Path(arg.partition("=")[2]))
    try:
        config, dims = check_command(args, world)
    except (ConfigError, ValueError) as e:
        if "needs torch 2.13 or newer" in str(e) and torch.__version__ < "2.13":
            return  # pipelining's documented refusal on older torch (docs/recipes.md says so)
        pytest.fail(f"{cmd.where}: `{cmd}` fails the recipe's checks on {world} ranks: {e}")
    assert dims.pp * dims.dp_replicate * dims.dp_shard * dims.tp == world


def _tiny_hf_llama(folder: Path) -> None:
    """A random-weight Hugging Face Llama folder, as docs/hf-finetune.md's first command makes it."""
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("_doc_tiny_hf_llama", REPO / "examples" / "tiny_hf_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(str(folder))


def check_hf_example(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    words = list(cmd.words)
    monkeypatch.chdir(tmp_path)
    _tiny_hf_llama(Path(words[2]))
    assert fsdp2.checkpoint.is_hf_folder(words[2]) and (Path(words[2]) / "model.safetensors").is_file()


def check_export_hf(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = list(cmd.words[cmd.words.index("export-hf"):])
    monkeypatch.chdir(tmp_path)
    source = Path(args[args.index("--hf-config") + 1]).parent
    _tiny_hf_llama(source)
    from fsdp2.models.llama import Transformer

    model = Transformer(fsdp2.checkpoint.model_args_from_hf(source))
    fsdp2.checkpoint.save(Path(args[1]) / "step-00000020", model)  # CHECKPOINT: a run's directory
    assert checkpoint_main(args) == 0
    config = json.loads((Path(args[2]) / "config.json").read_text())
    dtype = args[args.index("--dtype") + 1] if "--dtype" in args else "float32"
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == dtype


def check_export(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = list(cmd.words[cmd.words.index("export"):])
    if args[1:3] == ["DCP_DIR", "OUT.safetensors"]:  # the reference's synopsis
        args = ["export", "DCP_DIR", "OUT.safetensors", "--prefix", "model."]
    monkeypatch.chdir(tmp_path)
    source = Path(args[1])
    if source.name == "ckpt":  # a run's checkpoint directory (getting-started): step-N checkpoints in it
        source = source / "step-100"
    fsdp2.checkpoint.save(source, torch.nn.Linear(4, 3))
    assert checkpoint_main(args) == 0
    assert Path(args[2]).is_file()


def check_verify(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = list(cmd.words[cmd.words.index("verify"):])
    monkeypatch.chdir(tmp_path)
    fsdp2.checkpoint.save(Path(args[1]) / "step-00000100", torch.nn.Linear(4, 3))  # DIR: a run's directory
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert checkpoint_main(args) == 0
    assert out.getvalue().startswith("step-00000100: sound ("), out.getvalue()


def check_plan(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if any(word.endswith(".toml") for word in cmd.words):  # a recipe config, read as the checkout has it
        (tmp_path / "recipes").symlink_to(REPO / "recipes")
    if "--hf-config" in cmd.words:  # a model's config.json, as the user would have it
        config = Path(cmd.words[cmd.words.index("--hf-config") + 1])
        config.parent.mkdir(parents=True)
        config.write_text(json.dumps(LLAMA_3_8B_HF))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = plan.main(list(cmd.words[3:]))
    except SystemExit as e:
        code = e.code
    assert code == 0, f"{cmd.where}: `{cmd}` exited {code}:\n{out.getvalue()}"
    assert out.getvalue().strip(), f"{cmd.where}: `{cmd}` printed nothing"


def _benchmark(name: str):
    """benchmarks/<name>.py as a module (its dataclasses need it in sys.modules)."""
    module_name = f"_doc_benchmark_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, REPO / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def check_benchmark(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    world, script, args = _script(cmd)
    name = Path(script).stem
    module = _benchmark(name)
    try:
        if name == "step_time":
            module.parse_args(args)
        else:
            module.build_parser().parse_args(args)
    except SystemExit as e:
        pytest.fail(f"{cmd.where}: `{cmd}`: benchmarks/{name}.py refuses its arguments (exit {e.code})")


def check_lint(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cmd.words[-2:] == ("check", "."), cmd
    assert '"ruff", "check"' in (REPO / "tests/unit/test_lint.py").read_text()


def check_gpu_check(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cmd.words[1] == "benchmarks/gpu_check.sh" and set(cmd.words[2:-1]) <= {"--report", "--dry-run"}
    tests = (REPO / "tests/comm/test_gpu_check.py").read_text()
    assert "def test_without_a_gpu_it_asks_for_the_dry_run" in tests and "def test_dry_run_takes_every_step" in tests


def check_shell_setup(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = cmd.words[-1].split("=")[0] if cmd.words[0] == "export" else cmd.words[0].split("=")[0]
    assert name in SHELL_VARS or name == "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", cmd


def _is(*prefix: str) -> Callable[[Command], bool]:
    return lambda cmd: cmd.words[:len(prefix)] == prefix


def _runs(script: str) -> Callable[[Command], bool]:
    def match(cmd: Command) -> bool:
        words = cmd.words[1:] if cmd.words[0] == "srun" else cmd.words
        return words[0] in ("torchrun", "python") and any(w.startswith(script) for w in words)
    return match


RULES: dict[str, tuple[Callable[[Command], bool], Callable[..., None]]] = {
    "pip": (_is("python", "-m", "pip", "install"), check_pip),
    "pytest": (_is("python", "-m", "pytest"), check_pytest),
    "recipe": (_runs("recipes/train.py"), check_recipe),
    "export": (_is("python", "-m", "fsdp2.checkpoint", "export"), check_export),
    "export_hf": (_is("python", "-m", "fsdp2.checkpoint", "export-hf"), check_export_hf),
    "hf_example": (_runs("examples/tiny_hf_llama.py"), check_hf_example),
    "verify": (_is("python", "-m", "fsdp2.checkpoint", "verify"), check_verify),
    "plan": (_is("python", "-m", "fsdp2.plan"), check_plan),
    "gpu_check": (_is("bash", "benchmarks/gpu_check.sh"), check_gpu_check),
    "benchmark": (_runs("benchmarks/"), check_benchmark),
    "lint": (_is("ruff", "check"), check_lint),
    "shell": (lambda cmd: cmd.words[0] == "export" or "=$(" in " ".join(cmd.words), check_shell_setup),
}
COMMANDS = doc_commands()


def _distinct(commands: list[Command]) -> list[Command]:
    """One command per distinct text, named by every place that shows it: a check depends on
    the words alone, so the same command shown on three pages is checked once, for all three."""
    places: dict[tuple[str, ...], list[str]] = {}
    for cmd in commands:
        places.setdefault(cmd.words, []).append(cmd.where)
    return [Command(",".join(where), words) for words, where in places.items()]


def _rule(cmd: Command) -> str | None:
    return next((name for name, (match, _check) in RULES.items() if match(cmd)), None)


def test_the_docs_show_commands_and_every_one_has_a_rule():
    assert len(COMMANDS) > 40, "the command extraction found too few commands: is the fence syntax changed?"
    unclaimed = [f"{c.where}: {c}" for c in COMMANDS if _rule(c) is None]
    assert not unclaimed, "commands in the docs that no test runs or checks (add a rule here):\n" + "\n".join(unclaimed)
    assert {_rule(c) for c in COMMANDS} == set(RULES), "a rule claims no command: remove it"


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """A benchmark script checked in this process may set variables at import
    (``benchmarks/overhead.py``: ``FSDP2_CPU_COLLECTIVES=flat``): later tests must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# The planner's runs take seconds each: slow (tests/tools/test_plan_cli.py covers the planner in the quick run).
@pytest.mark.parametrize("cmd", [pytest.param(c, marks=pytest.mark.slow) if _rule(c) == "plan" else c
                                 for c in _distinct(COMMANDS) if _rule(c) is not None], ids=lambda c: f"{c.where}")
def test_doc_command(cmd: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _match, check = RULES[_rule(cmd)]
    if check in (check_pip, check_pytest):
        check(cmd, tmp_path)
    else:
        check(cmd, tmp_path, monkeypatch)


def test_a_wrong_command_fails_its_rule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks can fail: a bad key, a layout the world cannot hold, an unknown benchmark flag,
    an extra pyproject lacks."""
    bad = [
        ("recipe", "torchrun --nproc-per-node 2 recipes/train.py --training.stepz=3"),
        ("recipe", "torchrun --nproc-per-node 2 recipes/train.py --dp-shard 4"),
        ("benchmark", "torchrun --nproc-per-node 2 benchmarks/step_time.py --sweep 17M,huge"),
        ("benchmark", "python benchmarks/overhead.py --no-such-flag"),
    ]
    for rule, text in bad:
        (cmd,) = _commands_of(text, "test")
        where = tmp_path / str(len(list(where for where in tmp_path.iterdir())))
        where.mkdir()
        with pytest.raises(pytest.fail.Exception):
            RULES[rule][1](cmd, where, monkeypatch)
    (cmd,) = _commands_of("python -m pip install -e '.[no_such_extra]'", "test")
    with pytest.raises(AssertionError, match="no_such_extra"):
        check_pip(cmd, tmp_path)
    (cmd,) = _commands_of("python -m pip install torch==2.10.0", "test")
    with pytest.raises(AssertionError, match="outside"):
        check_pip(cmd, tmp_path)
