"""The recipe's Hugging Face tokenizers and data formats (``--tokenizer``, ``--data`` rows; recipes/hf_data.py).

- A WordLevel tokenizer built here from a known vocabulary (no download) packs JSON Lines,
  Parquet and a ``datasets.save_to_disk`` folder (two shards) into the same stream: each
  document's word ids in order, the EOS id between documents; the expected stream is written
  from the vocabulary by hand, not by the code under test.
- The EOS id comes from ``data.eos_token``, tokenizer_config.json, config.json or a usual name,
  and a tokenizer with none is refused naming ``--data.eos_token``.
- ``model.vocab_size`` follows the tokenizer; a smaller one on the command line is refused.
- The batches of a step are the same in a fresh process (a restart) as in this one.
- Bad inputs are one line each, from ``check_command`` (before any process group): a missing
  field (naming the fields present), file, tokenizer, and the ``hf`` extra missing (a
  subprocess where the import fails; the same fresh process then gives the restart's batches).
- A 2-rank torchrun with a BPE tokenizer trained here and JSON Lines runs a few steps.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recipes.config import ConfigError
from recipes.data import get_batch, load_corpus, load_data, load_tokenizer, split_corpus, tokenizer_vocab_size
from recipes.checks import check_command
from tests.tools.test_recipe import REPO, SMALL_MODEL, TRAIN, _records

WORDS = ["<unk>", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "it"]
VOCAB = {w: i for i, w in enumerate(WORDS)}
DOCS = ["the cat sat on the mat", "a dog ran to it", "it sat", "the dog sat on a cat"]
EXPECTED = [VOCAB[w] for w in DOCS[0].split()]
for doc in DOCS[1:]:
    EXPECTED += [VOCAB["</s>"]] + [VOCAB[w] for w in doc.split()]
SHORT = [*SMALL_MODEL, "--model.max_seq_len=8", "--training.seq_len=8"]


def _word_level(folder: Path, *, vocab: dict[str, int] = VOCAB) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The same documents as a JSONL file, a folder of two JSONL files, Parquet, and a datasets folder."""
    import datasets  # (the test extra's: it writes the folder; the recipe reads it with pyarrow alone)

    root = tmp_path_factory.mktemp("hfdata")
    _jsonl(root / "docs.jsonl", DOCS)
    (root / "jsonl_dir").mkdir()
    _jsonl(root / "jsonl_dir" / "a.jsonl", DOCS[:2])  # sorted by name: a, then b
    _jsonl(root / "jsonl_dir" / "b.jsonl", DOCS[2:])
    pq.write_table(pa.table({"id": list(range(4)), "text": DOCS}), root / "docs.parquet", row_group_size=3)
    datasets.Dataset.from_dict({"text": DOCS, "id": list(range(4))}).save_to_disk(root / "saved", num_shards=2)
    return root, _word_level(root / "tok")


@pytest.mark.parametrize("name", ["docs.jsonl", "jsonl_dir", "docs.parquet", "saved"])
def test_every_format_packs_the_documents_with_eos_between(data, name):
    root, tok = data
    tokenizer = load_tokenizer(str(tok))
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (len(WORDS), VOCAB["</s>"])  # "</s>": a usual EOS name
    corpus = load_corpus(str(root / name), tokenizer)
    assert corpus.tolist() == EXPECTED


def test_bytes_of_rows_and_a_text_file_with_a_tokenizer(data, tmp_path):
    root, tok = data
    # The byte tokenizer packs rows as UTF-8 with a newline between, as it joins files.
    assert bytes(load_corpus(str(root / "docs.jsonl")).tolist()) == "\n".join(DOCS).encode()
    text = tmp_path / "one.txt"  # a text file with a tokenizer: one document
    text.write_text("the cat\nsat")
    assert load_corpus(str(text), load_tokenizer(str(tok))).tolist() == [VOCAB[w] for w in ("the", "cat", "sat")]


def test_eos_from_the_folders_files_or_named(tmp_path):
    vocab = {w: i for i, w in enumerate(["<unk>", "<end>", "<sep>", "the", "cat"])}  # no usual EOS name
    folder = _word_level(tmp_path / "model", vocab=vocab)
    with pytest.raises(ValueError, match=r"cannot tell its end-of-sequence token .* --data.eos_token=TOKEN"):
        load_tokenizer(str(folder))
    assert load_tokenizer(str(folder), eos_token="<sep>").eos_id == 2
    with pytest.raises(ValueError, match=r"data.eos_token='<nope>' is not in the vocabulary of --tokenizer"):
        load_tokenizer(str(folder), eos_token="<nope>")
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))  # several: the first
    load_tokenizer.cache_clear()
    assert load_tokenizer(str(folder)).eos_id == 2
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>"}}))
    load_tokenizer.cache_clear()
    assert load_tokenizer(str(folder)).eos_id == 1  # tokenizer_config.json before config.json
    assert load_tokenizer(str(folder / "tokenizer.json")).eos_id == 1  # the file: its folder's files count
    assert tokenizer_vocab_size(str(folder)) == 5


def test_model_vocab_follows_the_tokenizer(data):
    root, tok = data
    args = [*SHORT, "--tokenizer", str(tok), "--data", str(root / "docs.jsonl")]
    config, _dims = check_command(args, 1)
    assert config.model.vocab_size == len(WORDS)
    # The pre-flight check tokenized the data; training gets that stream, not a second pass.
    assert load_data(config.data) is load_data(config.data) and load_data(config.data).tolist() == EXPECTED
    config, _dims = check_command([*args, "--model.vocab_size=64"], 1)  # larger: padding, kept
    assert config.model.vocab_size == 64
    with pytest.raises(ConfigError, match=r"model.vocab_size=10 is smaller than the 12 token ids of --tokenizer "):
        check_command([*args, "--model.vocab_size=10"], 1)
    with pytest.raises(ConfigError, match=r"model.vocab_size=100 is smaller than the 256 token ids of the byte"):
        check_command([*SHORT, "--model.vocab_size=100"], 1)


def test_batches_of_a_step_are_the_same_after_a_restart(data, fresh_process):
    root, tok = data
    corpus = load_corpus(str(root / "saved"), load_tokenizer(str(tok)))
    train, held_out = split_corpus(corpus, 0.2)
    assert torch.equal(torch.cat([train, held_out]), corpus) and held_out.numel() == int(corpus.numel() * 0.2)
    here = [get_batch(corpus, seed=0, step=s, rank=1, micro=0, batch_size=3, seq_len=4)[0].tolist() for s in (1, 7)]
    assert here[0] != here[1]
    assert fresh_process["batches"] == here


# ---- one-line errors before any process group ------------------------------------------------
def _error(args: list[str]) -> str:
    with pytest.raises((ConfigError, ValueError)) as e:
        check_command([*SHORT, *args], 1)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_inputs_are_one_line_each(data, tmp_path):
    root, tok = data
    other = _jsonl(tmp_path / "other.jsonl", DOCS, field="body")
    assert _error(["--tokenizer", str(tok), "--data", str(other)]) == (
        f"--data {other}: {other} line 1 has no field 'text' (its fields: id, body); name the text's with "
        "--data.text_field=NAME")
    config, _ = check_command([*SHORT, "--tokenizer", str(tok), "--data", str(other), "--data.text_field=body"], 1)
    assert config.data.text_field == "body"
    for name in ("docs.parquet", "saved"):
        assert f"has no field 'content' (its fields: {'id, text' if name == 'docs.parquet' else 'text, id'})" in \
            _error(["--tokenizer", str(tok), "--data", str(root / name), "--data.text_field=content"])
    assert "field 'id' holds int64, not text" in _error(["--data", str(root / "saved"), "--data.text_field=id"])
    assert _error(["--data", str(tmp_path / "none.jsonl")]) == f"--data {tmp_path / 'none.jsonl'}: no such file or " \
        "directory"
    assert _error(["--tokenizer", str(tmp_path / "none"), "--data", str(other)]) == \
        f"--tokenizer {tmp_path / 'none'}: no such file or directory"
    (tmp_path / "empty_model").mkdir()
    (tmp_path / "empty_model" / "tokenizer.model").write_bytes(b"")
    assert "the folder has no tokenizer.json (it has tokenizer.model" in \
        _error(["--tokenizer", str(tmp_path / "empty_model")])
    short = _jsonl(tmp_path / "short.jsonl", ["the cat"])
    assert _error(["--tokenizer", str(tok), "--data", str(short)]) == \
        f"--data {short}: 2 tokens, fewer than training.seq_len + 2 = 10; give more data or shorten training.seq_len"
    (tmp_path / "mixed").mkdir()
    _jsonl(tmp_path / "mixed" / "a.jsonl", DOCS)
    (tmp_path / "mixed" / "b.txt").write_text("text")
    assert "the folder mixes .jsonl, .txt files" in _error(["--data", str(tmp_path / "mixed")])
    assert "a DatasetDict folder (splits: train); give one split's folder" in \
        _error(["--data", str(_dataset_dict(tmp_path))])


def _dataset_dict(tmp_path: Path) -> Path:
    (tmp_path / "dd" / "train").mkdir(parents=True)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    (tmp_path / "dd" / "train" / "state.json").write_text("{}")
    return tmp_path / "dd"


# One fresh interpreter (a python + torch start costs seconds) serves two tests: first, with the
# ``hf`` extra's packages made unimportable, the pre-flight's errors; then, with them importable
# again (the recipe imports them on first use only), a restart's batches of two steps.
_FRESH = """
import json, sys
for name in ("tokenizers", "pyarrow"):
    sys.modules[name] = None  # the import fails as if the package were not installed
from recipes.checks import check_command
errors = []
for args in json.loads(sys.argv[1]):
    try:
        check_command(args, 1)
    except ValueError as e:
        errors.append(str(e))
for name in ("tokenizers", "pyarrow"):
    del sys.modules[name]  # installed again
from recipes.data import get_batch, load_corpus, load_tokenizer
corpus = load_corpus(sys.argv[2], load_tokenizer(sys.argv[3]))
batches = [get_batch(corpus, seed=0, step=s, rank=1, micro=0, batch_size=3, seq_len=4)[0].tolist() for s in (1, 7)]
print(json.dumps({"errors": errors, "batches": batches}))
"""


@pytest.fixture(scope="module")
def fresh_process(data):
    root, tok = data
    runs = [[*SHORT, "--tokenizer", str(tok), "--data", str(root / "docs.jsonl")],
            [*SHORT, "--data", str(root / "docs.parquet")], [*SHORT, "--data", str(root / "saved")],
            [*SHORT, "--data", str(root / "docs.jsonl")]]  # JSON Lines needs neither
    proc = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(runs), str(root / "saved"), str(tok)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_missing_extra_is_named(data, fresh_process):
    root, _tok = data
    install = "pip install 'fsdp2[hf]' (in a checkout: pip install -e '.[hf]')"
    assert fresh_process["errors"] == [
        f"--tokenizer needs the tokenizers package: {install}",
        f"--data {root / 'docs.parquet'} (.parquet files) needs the pyarrow package: {install}",
        f"--data {root / 'saved'} (a datasets folder) needs the pyarrow package: {install}",
    ]


def test_no_op_data_settings_are_warned_about(data):
    from recipes.config import command_line_keys
    from recipes.preflight import no_op_warnings

    root, _tok = data
    args = [*SHORT, "--data.eos_token=</s>", "--data.text_field=body"]
    config, _ = check_command(args, 1)
    warnings = no_op_warnings(config, command_line_keys(args))
    assert "data.eos_token=</s>: no effect without data.tokenizer (--tokenizer; bytes separate documents by a " \
        "newline)" in warnings
    assert any(w.startswith("data.text_field=body: no effect on text files") for w in warnings)


# ---- a 2-rank run ------------------------------------------------------------------------------
def _bpe(folder: Path, texts: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<|endoftext|>"]))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.slow  # torchrun's start: tens of seconds on 2 cores
def test_torchrun_trains_on_jsonl_with_a_bpe_tokenizer(tmp_path):
    gen = torch.Generator().manual_seed(0)
    words = WORDS[2:]
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=gen).tolist())
            for _ in range(200)]
    tok = _bpe(tmp_path / "bpe", docs)
    data_path = _jsonl(tmp_path / "docs.jsonl", docs)
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(TRAIN),
           *SMALL_MODEL, "--tokenizer", str(tok), "--data", str(data_path), "--steps", "6",
           "--training.batch_size=4", "--training.warmup_steps=2", "--training.lr=1e-2", "--metrics.log_every=1",
           "--metrics.sample_tokens=5", "--metrics.plot=false", "--metrics-file", str(metrics), "--validation.enable",
           "--validation.split=0.1", "--validation.steps=1", "--validation.freq=3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    vocab = load_tokenizer(str(tok)).vocab_size
    assert f"vocab {vocab}" in proc.stdout and "(jsonl, field 'text')" in proc.stdout, proc.stdout
    records = _records(metrics)
    losses = [records[s]["loss"] for s in range(1, 7)]
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[0] == pytest.approx(math.log(vocab), abs=0.1), "the initial model predicts the vocabulary uniformly"
    assert losses[-1] < losses[0] - 0.3, losses
    assert math.isfinite(records[6]["val_loss"])
