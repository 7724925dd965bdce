"""Hugging Face Llama models in and out of the recipe, on CPU, with nothing downloaded.

A random-weight ``LlamaForCausalLM`` (tiny, grouped-query attention, tied and untied) is saved
with ``save_pretrained``; the recipe builds its model from that ``config.json`` and loads the
weights on 2 gloo ranks, under FSDP and under FSDP x TP (dp_shard 1 x tp 2):

- at step 0 its logits equal transformers' on the same tokens (fp32 tolerance);
- it fine-tunes a few steps on JSON Lines documents with a BPE ``tokenizer.json`` trained in the
  test by ``tokenizers`` (100 tokens; the model's vocabulary is 320)
  and exports with ``checkpoint.export_hf`` (and its own ``checkpoint.export``):
  ``LlamaForCausalLM.from_pretrained`` loads the export, its logits equal the recipe's final
  model's (rebuilt from ``checkpoint.export``), and ``generate`` runs;
- ``python -m fsdp2.checkpoint export-hf`` writes the same model from the run's DCP checkpoint,
  sharded with an index;
- Llama 3.1's rotary scaling (``rope_type`` "llama3") loads with the same logits;
- bad inputs stop in one line before anything is allocated: another architecture, another rope
  scaling, a missing tensor, a tokenizer larger than the model's vocabulary, a command-line
  shape that contradicts config.json.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from fsdp2.checkpoint import load_full, load_hf  # noqa: E402
from fsdp2.checkpoint.__main__ import main as checkpoint_main  # noqa: E402
from fsdp2.models.llama import Transformer  # noqa: E402
from recipes.build import build_model  # noqa: E402
from recipes.checks import check_command  # noqa: E402
from recipes.checkpoint import load_initial  # noqa: E402
from recipes.config import ConfigError, parse_args  # noqa: E402
from recipes.llama.parallelize import ParallelDims, check_layout  # noqa: E402
from tests._dist import run_on_ranks  # noqa: E402
from tests.tools.test_recipe import _train_on_ranks  # noqa: E402

VOCAB = 320  # byte tokens (< 256) fit; 320 splits evenly over 2 ranks
SEQ = 16
RUN = ["--model.max_seq_len=32", f"--training.seq_len={SEQ}", "--training.batch_size=2", "--training.warmup_steps=1",
       "--training.lr=1e-2", "--metrics.log_every=1", "--metrics.sample_tokens=0", "--metrics.plot=false"]
LAYOUTS = {"fsdp": ["--dp-shard", "2", "--tp", "1"], "fsdp_tp": ["--dp-shard", "1", "--tp", "2"]}
# Llama 3.1's rotary scaling, with an original context short enough to scale this model's frequencies.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
TOKENS = torch.arange(2 * SEQ).reshape(2, SEQ) * 7 % 256  # (batch, seq): byte ids


def _hf_config(tied: bool, **changes) -> LlamaConfig:
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaConfig(**{**fields, **changes})


def _save(folder: Path, tied: bool, seed: int = 0, shard: str | None = None, **changes) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(_hf_config(tied, **changes))
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {"untied": _save(root / "untied", tied=False), "tied": _save(root / "tied", tied=True, seed=1),
            "sharded": _save(root / "sharded", tied=False, seed=2, shard="20KB"),
            "llama3": _save(root / "llama3", tied=False, seed=3, initializer_range=0.2, rope_scaling=LLAMA3_ROPE)}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[str]:
    """JSON Lines documents and a BPE ``tokenizer.json`` trained on them here (no download):
    ``--data`` and ``--tokenizer`` for a fine-tuning run."""
    tokenizers = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("data")
    words = ["def", "add", "return", "a", "b", "sum", "print", "value", "list", "item", "for", "in"]
    gen = torch.Generator().manual_seed(0)
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (10,), generator=gen).tolist())
            for _ in range(120)]
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(docs, tokenizers.trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "</s>"]))
    tok.save(str(root / "tokenizer.json"))
    assert tok.get_vocab_size() < VOCAB  # the model's vocabulary holds every id the tokenizer makes
    return [f"--data={root / 'docs.jsonl'}", f"--tokenizer={root / 'tokenizer.json'}"]


def _hf_logits(folder: Path, tokens: torch.Tensor = TOKENS) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits


def _step0_logits(argv: list[str]) -> torch.Tensor:
    """On every rank: the recipe's model built and loaded as a run does, its logits on TOKENS."""
    config = parse_args(argv)
    p = config.parallelism
    dims = ParallelDims(p.dp_replicate, p.dp_shard, p.tp, dist.get_world_size())
    check_layout(dims, config)
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"))
    load_initial(config.checkpoint.initial_load_path, model)
    with torch.no_grad():
        return model(TOKENS).detach().clone()


@pytest.mark.parametrize("kind,layout", [("untied", "fsdp"), ("tied", "fsdp"), ("untied", "fsdp_tp"),
                                         ("sharded", "fsdp_tp"), ("llama3", "fsdp")])
def test_step0_logits_equal_transformers(hf_models, kind, layout):
    folder = hf_models[kind]
    if kind == "sharded":  # save_pretrained split it: the recipe reads the index
        assert (folder / "model.safetensors.index.json").is_file()
    argv = [*RUN, *LAYOUTS[layout], f"--checkpoint.initial_load_path={folder}"]
    config = parse_args(argv)
    assert (config.model.dim, config.model.n_kv_heads, config.model.vocab_size, config.model.ffn_hidden,
            config.model.tie_embeddings, config.model.rope_theta, config.model.norm_eps) == \
        (32, 2, VOCAB, 72, kind == "tied", 5000.0, 1e-5)
    expected = _hf_logits(folder)
    if kind == "llama3":  # the scaling is read, and it matters: unscaled rotations give other logits
        assert (config.model.rope_scaling_factor, config.model.rope_original_max_seq_len) == (8.0, 16)
        unscaled = Transformer(dataclasses.replace(config.model, rope_scaling_factor=1.0))
        load_hf(folder, unscaled)
        with torch.no_grad():
            assert (unscaled(TOKENS) - expected).abs().max() > 1e-3
    for logits in run_on_ranks(_step0_logits, 2, argv, timeout=120.0):
        torch.testing.assert_close(logits, expected, atol=2e-5, rtol=1e-5)


def _final_model(export: Path, folder: Path) -> Transformer:
    """The recipe's final model, unsharded, from its own checkpoint.export file."""
    config = parse_args([*RUN, f"--checkpoint.initial_load_path={folder}"])
    model = Transformer(config.model)
    load_full(export, model)
    return model.eval()


@pytest.mark.parametrize("kind,layout", [("untied", "fsdp"), ("tied", "fsdp"), ("untied", "fsdp_tp")])
def test_finetune_export_and_from_pretrained(hf_models, corpus, tmp_path, kind, layout):
    folder = hf_models[kind]
    out, ckpt = tmp_path / "hf_out", tmp_path / "ckpt"
    argv = [*RUN, *LAYOUTS[layout], "--training.steps=3", *corpus, f"--checkpoint.initial_load_path={folder}",
            f"--checkpoint.export_hf={out}", f"--checkpoint.export={tmp_path / 'final.safetensors'}",
            f"--checkpoint-dir={ckpt}"]
    config, _ = check_command(argv, 2)  # what main() checks first: the tokenizer fits the model's vocabulary
    assert config.model.vocab_size == VOCAB  # config.json's, not the tokenizer's
    run_on_ranks(_train_on_ranks, 2, argv, timeout=240.0)
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["tie_word_embeddings"], config["intermediate_size"]) == \
        (["LlamaForCausalLM"], kind == "tied", 72)
    final = _final_model(tmp_path / "final.safetensors", folder)
    with torch.no_grad():
        ours = final(TOKENS)
    exported = LlamaForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        theirs = exported(TOKENS).logits
    torch.testing.assert_close(theirs, ours, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(theirs, _hf_logits(folder), atol=1e-3), "fine-tuning changed nothing"
    generated = exported.generate(TOKENS[:1, :4], max_new_tokens=6, do_sample=False)
    assert generated.shape == (1, 10) and torch.equal(generated[0, :4], TOKENS[0, :4])

    # Offline, from the run's DCP checkpoint: sharded with an index, in bfloat16.
    offline = tmp_path / "offline"
    assert checkpoint_main(["export-hf", str(ckpt), str(offline), "--hf-config", str(folder / "config.json"),
                            "--max-shard-size", "20KB", "--dtype", "bfloat16"]) == 0
    index = json.loads((offline / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert ("lm_head.weight" in index["weight_map"]) == (kind == "untied")
    reloaded = LlamaForCausalLM.from_pretrained(offline, dtype=torch.float32).eval()
    for name, param in exported.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], param.to(torch.bfloat16).float(), atol=0, rtol=0)


def test_llama3_scaling_round_trips_in_one_process(hf_models, tmp_path):
    """export_hf without a process group: the llama3 rope parameters and the weights come back."""
    from fsdp2.checkpoint import export_hf, model_args_from_hf

    model = Transformer(model_args_from_hf(hf_models["llama3"])).eval()
    load_hf(hf_models["llama3"], model)
    export_hf(tmp_path / "out", model)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 5000.0}
    with torch.no_grad():
        torch.testing.assert_close(_hf_logits(tmp_path / "out"), model(TOKENS), atol=2e-5, rtol=1e-5)


def test_a_rank_reads_only_the_span_its_permuted_rows_come_from(hf_models):
    """The q/k row order makes a rank's rows non-contiguous in the file: it reads their span, no more."""
    from safetensors import safe_open

    from fsdp2.checkpoint._full import _Reordered
    from fsdp2.checkpoint._hf import hf_row_order

    head_dim, heads = 8, 4
    order = hf_row_order(heads, head_dim)
    assert sorted(order.tolist()) == list(range(heads * head_dim))
    assert order[:4].tolist() == [0, 4, 1, 5]  # rows 2i, 2i+1 of a head are rows i, i + head_dim/2 in the file

    class Recorded:  # a real safetensors slice that records what is read from it
        def __init__(self, source):
            self.source, self.read = source, []

        def __getitem__(self, index):
            self.read.append(index)
            return self.source[index]

    name = "model.layers.0.self_attn.q_proj.weight"
    with safe_open(hf_models["untied"] / "model.safetensors", framework="pt") as f:
        full = f.get_tensor(name)
        source = Recorded(f.get_slice(name))
        rows = _Reordered(source, order)[slice(9, 13), slice(4, 20)]  # rank-like box: rows 9..12, columns 4..19
    torch.testing.assert_close(rows, full[order[9:13]][:, 4:20], atol=0, rtol=0)
    (index,) = source.read
    assert (index[0].start, index[0].stop) == (order[9:13].min().item(), order[9:13].max().item() + 1)
    assert index[0].stop - index[0].start <= 4 + head_dim and index[1] == slice(4, 20)


# ---- bad inputs: one line, before anything is allocated ------------------------------------------
def _refused(argv: list[str]) -> str:
    with pytest.raises((ConfigError, ValueError)) as info:
        check_command([*RUN, *argv], 2)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_another_architecture_is_refused(tmp_path, hf_models):
    folder = tmp_path / "gpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**_hf_config(False).to_dict(), "model_type": "mistral",
                                                    "architectures": ["MistralForCausalLM"]}))
    assert "model_type 'mistral' is not supported" in _refused([f"--checkpoint.initial_load_path={folder}"])


@pytest.mark.parametrize("change,expected", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
     "rope_scaling of type 'yarn' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_what_the_model_cannot_express_is_refused(tmp_path, change, expected):
    folder = _save(tmp_path / "m", tied=False, **change)
    assert expected in _refused([f"--checkpoint.initial_load_path={folder}"])


def test_a_missing_tensor_is_refused(tmp_path, hf_models):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "partial"
    folder.mkdir()
    (folder / "config.json").write_text((hf_models["untied"] / "config.json").read_text())
    tensors = load_file(hf_models["untied"] / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    message = _refused([f"--checkpoint.initial_load_path={folder}"])
    assert "tensor model.layers.1.mlp.up_proj.weight is missing" in message, message


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    folder = _save(tmp_path / "small_vocab", tied=False, vocab_size=200)
    message = _refused([f"--checkpoint.initial_load_path={folder}"])
    assert "the tokenizer has 256 tokens but" in message and "vocab_size 200" in message, message


def test_a_folder_without_weights_is_refused(tmp_path, hf_models):
    folder = tmp_path / "config_only"
    folder.mkdir()
    (folder / "config.json").write_text((hf_models["untied"] / "config.json").read_text())
    assert "holds neither model.safetensors.index.json nor model.safetensors" in \
        _refused([f"--checkpoint.initial_load_path={folder}"])


def test_a_contradicting_shape_and_tied_tp_are_refused(hf_models):
    assert "--model.dim=64 contradicts" in _refused([f"--checkpoint.initial_load_path={hf_models['untied']}",
                                                     "--model.dim=64"])
    assert "tie_embeddings" in _refused([f"--checkpoint.initial_load_path={hf_models['tied']}", *LAYOUTS["fsdp_tp"]])
