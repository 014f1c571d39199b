"""Hugging Face GPT-2 import / export: parity with transformers on small random GPT2LMHeadModels built here
(nothing is downloaded), GPT-2 tokenizer parity, fine-tuning, and one clear line for each bad input."""

import argparse
import dataclasses
import errno
import gzip
import json
import os
import shutil
from importlib import resources

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast, PreTrainedTokenizerFast

from helpers import HF_SHAPES, HF_VOCAB, hf_folder, run_bad, run_ok, tree
from gptlab.checkpoint import load_run
from gptlab.config import PRESETS, ModelConfig, SampleConfig, TrainConfig, build
from gptlab.data.batches import load_dataset
from gptlab.data.prepare import prepare
from gptlab.engine import generate
from gptlab.errors import GptlabError
from gptlab.evaluate import total_nats
import gptlab.hf.gpt2_folders
from gptlab.hf.gpt2_folders import CONV1D, export_hf, import_hf, init_tensors, load_hf_model
from gptlab.hf.hf_tokenizer import gpt2_merges, gpt2_vocab, write_tokenizer_files
from gptlab.model import GPT
from gptlab.tokenizer import EOT, GPT2Tokenizer
from gptlab.training.train import train

PROMPT = [5, 17, 99, 3, 250, 7, 8, 9]
VARIED = ("Héllo wörld — naïve café 😀🚀 👩‍👩‍👧 日本語テキスト, Ελληνικά, العربية; e\u0301\n\n\n\t  spaces   and\r\n"
          "12345 3.14159 1,000,000 don't we'll I'M they've she'd it's 'quoted' ''double''   \n \n  x\u00a0y   ")


def load_hf(path):
    model, info = GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def our_greedy(model, prompt, n):
    return [ids[0] for ids in generate(model, prompt, SampleConfig(max_new_tokens=n, temperature=0))]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: hf_folder(root / name, seed=i, **shape) for i, (name, shape) in enumerate(HF_SHAPES.items())}


# ---- import parity ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", HF_SHAPES)
def test_imported_logits_equal_transformers(folders, name):
    hf, ours = load_hf(folders[name]), load_hf_model(folders[name])
    x = torch.randint(HF_VOCAB, (3, HF_SHAPES[name]["n_positions"]))
    with torch.no_grad():
        diff = (ours(x)[0] - hf(x).logits).abs().max().item()
    assert diff <= 1e-5


@pytest.mark.parametrize("name", HF_SHAPES)
def test_greedy_generation_gives_identical_ids(folders, name):
    # 64 new tokens where the context allows; transformers cannot go past n_positions, where gptlab slides its
    # window instead, so the context-40 model is compared on the 32 tokens that fit.
    n = min(64, HF_SHAPES[name]["n_positions"] - len(PROMPT))
    hf, ours = load_hf(folders[name]), load_hf_model(folders[name])
    mine = our_greedy(ours, PROMPT, n)
    assert len(mine) == n and mine == hf_greedy(hf, PROMPT, n)
    assert len(set(mine)) > 1  # not a degenerate constant continuation


@pytest.mark.parametrize("name", HF_SHAPES)
def test_gradients_of_the_loss_match(folders, name):
    hf, ours = load_hf(folders[name]), load_hf_model(folders[name])
    T = HF_SHAPES[name]["n_positions"]
    x, y = torch.randint(HF_VOCAB, (2, T)), torch.randint(HF_VOCAB, (2, T))
    ours(x, y)[1].backward()
    F.cross_entropy(hf(x).logits.view(-1, HF_VOCAB), y.view(-1)).backward()
    theirs = dict(hf.named_parameters())
    mine = dict(ours.named_parameters())
    assert set(mine) == set(theirs)
    for pname, p in mine.items():
        grad = p.grad.t() if pname.endswith(CONV1D) else p.grad
        ref = theirs[pname].grad
        assert ref.norm() > 0, pname
        assert ((grad - ref).norm() / ref.norm()).item() <= 1e-5, pname


def test_old_sharded_and_pickled_checkpoints_import_the_same(tmp_path, folders):
    """Legacy pytorch_model.bin (no `transformer.` prefix, causal-mask buffers, an explicit tied lm_head) and
    sharded safetensors load to the same weights as the plain folder."""
    source = folders["5-heads-60-wide"]
    reference = load_hf_model(source).state_dict()
    load_hf(source).save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(source / "config.json", legacy)
    state = {k.removeprefix("transformer."): v for k, v in load_file(source / "model.safetensors").items()}
    n = HF_SHAPES["5-heads-60-wide"]["n_positions"]
    for layer in range(2):
        state[f"h.{layer}.attn.bias"] = torch.ones(n, n).tril().view(1, 1, n, n)
        state[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    state["lm_head.weight"] = state["wte.weight"]
    torch.save(state, legacy / "pytorch_model.bin")

    for folder in (tmp_path / "sharded", legacy):
        loaded = load_hf_model(folder).state_dict()
        assert all(torch.equal(loaded[k], reference[k]) for k in reference), folder


# ---- export round trip -----------------------------------------------------------------------------------------

EXPORTS = {  # a model trained here: (tokenizer, model overrides)
    "char-bias-gelu-tanh": ("char", dict(activation="gelu_tanh")),
    "char-no-bias-padded-vocab": ("char", dict(bias=False, vocab_size=64)),
    "bpe-exact-gelu-eps-1e-6": ("bpe", dict(layer_norm_eps=1e-6)),
}


def train_tiny(tmp_path, corpus_file, tokenizer, **model):
    data = tmp_path / f"data-{tokenizer}"
    prepare([str(corpus_file)], data, tokenizer, vocab_size=300, quiet=True)
    model_cfg = ModelConfig(**{"block_size": 96, "n_layer": 2, "n_head": 3, "n_embd": 48, **model})
    cfg = TrainConfig(max_steps=10, batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=0, eval_interval=10,
                      eval_batches=1, log_interval=10, precision="fp32", device="cpu")
    train(data, tmp_path / "run", model_cfg, cfg, quiet=True)
    return tmp_path / "run", load_dataset(data)


@pytest.mark.parametrize("name", EXPORTS)
def test_export_round_trip_gives_the_same_logits_and_continuation(tmp_path, corpus_file, name):
    kind, model = EXPORTS[name]
    run, data = train_tiny(tmp_path, corpus_file, kind, **model)
    export_hf(run, tmp_path / "hf")
    loaded, hf = load_run(run), load_hf(tmp_path / "hf")
    V = data.tokenizer.vocab_size
    assert hf.config.vocab_size == V and hf.config.n_positions == 96
    x = torch.as_tensor(data.val[:2 * 96].astype("int64")).view(2, 96)
    with torch.no_grad():
        ours = loaded.model(x)[0]
        assert (ours[..., :V] - hf(x).logits).abs().max().item() <= 1e-5
    if "vocab_size" not in model:  # a padded model may pick a padding id, which the export cuts away
        prompt = x[0, :16].tolist()
        assert our_greedy(loaded.model, prompt, 64) == hf_greedy(hf, prompt, 64)
    if not model.get("bias", True):
        exported = load_file(tmp_path / "hf" / "model.safetensors")
        assert not exported["transformer.h.0.mlp.c_fc.bias"].any() and not exported["transformer.ln_f.bias"].any()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for text in [corpus_file.read_text()[:500]] + [VARIED] * (kind == "bpe"):  # byte-level BPE: any text
        assert tokenizer.encode(text) == data.tokenizer.encode(text)
        assert tokenizer.decode(data.tokenizer.encode(text)) == text


def test_export_then_import_is_the_same_run(tmp_path, corpus_file, capsys, monkeypatch):
    run, data = train_tiny(tmp_path, corpus_file, "char", bias=False, vocab_size=64)
    monkeypatch.chdir(tmp_path)
    before = os.umask(0o027)  # the export's files follow the umask (safetensors alone would write 0600)
    try:
        assert "model.safetensors" in run_ok(capsys, "export", str(run), "--format", "hf", "--out", "hf")
    finally:
        os.umask(before)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o640}, modes
    assert "imported" in run_ok(capsys, "import", "hf", "--run", "back")
    before, after = load_run(run), load_run(tmp_path / "back")
    assert after.tokenizer.to_dict() == before.tokenizer.to_dict()
    assert after.model_cfg.bias and after.model_cfg.vocab_size == data.tokenizer.vocab_size  # zero biases, cut
    x = torch.as_tensor(data.val[:96].astype("int64"))[None]
    with torch.no_grad():
        assert torch.equal(after.model(x)[0], before.model(x)[0][..., :data.tokenizer.vocab_size])


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("fails", ["model.safetensors", "tokenizer files"])
def test_a_failed_export_changes_nothing_on_disk(tmp_path, gpt2_vocab_folder, capsys, monkeypatch, fails):
    monkeypatch.chdir(tmp_path)
    import_hf(gpt2_vocab_folder, tmp_path / "run")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text("{}")
    (tmp_path / "old" / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    with monkeypatch.context() as m:
        if fails == "model.safetensors":
            m.setattr(gptlab.hf.gpt2_folders, "save_file", no_space)
        else:  # one file written, then the disk is full
            m.setattr(gptlab.hf.gpt2_folders, "write_tokenizer_files", lambda out, *_: ((out / "vocab.json").write_text("{}"),
                                                                          no_space()))
        for out in ("old", "new/deeper/hf"):
            assert "No space left on device" in run_bad(capsys, "export", "run", "--out", out, "--overwrite")
            assert tree(tmp_path) == before, out
    run_ok(capsys, "export", "run", "--out", "old", "--overwrite")  # a folder with files: ours replace theirs
    assert load_hf(tmp_path / "old").config.n_embd == 32 and (tmp_path / "old" / "notes.txt").read_text() == "mine"
    run_ok(capsys, "export", "run", "--out", "new/deeper/hf")
    assert load_hf(tmp_path / "new" / "deeper" / "hf").config.n_head == 2
    for folder in (tmp_path, tmp_path / "old", tmp_path / "new" / "deeper", tmp_path / "new" / "deeper" / "hf"):
        assert not list(folder.glob(".*")), folder  # no staging folder or temporary file left behind


# ---- GPT-2 tokenizer -------------------------------------------------------------------------------------------

def test_gpt2_vocabulary_and_merges_derived_from_the_bundled_ranks():
    vocab, merges = gpt2_vocab(), gpt2_merges()
    assert len(vocab) == 50257 and len(merges) == 50000
    assert vocab["Hello"] == 15496 and vocab["Ġthe"] == 262 and vocab[EOT] == 50256
    assert merges[:3] == [("Ġ", "t"), ("Ġ", "a"), ("h", "e")]
    assert all(vocab[a + b] == 256 + i for i, (a, b) in enumerate(merges))  # merge i makes token 256 + i


def test_gpt2_tokenizer_matches_transformers_built_from_the_same_vocabulary(tmp_path):
    ours = GPT2Tokenizer()
    (tmp_path / "all").mkdir()
    (tmp_path / "bpe").mkdir()
    write_tokenizer_files(tmp_path / "all", ours, 1024)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tmp_path / "all" / name, tmp_path / "bpe")
    shakespeare = gzip.decompress(resources.files("gptlab").joinpath("assets/tinyshakespeare.txt.gz")
                                  .read_bytes()).decode()[:20000]
    texts = [VARIED, shakespeare, " leading space", "trailing   ", "\n\n\n", "a" * 300, "0123456789" * 5]
    # transformers' GPT-2 tokenizer from vocab.json + merges.txt, the whole folder, and tokenizer.json alone
    for hf in (GPT2TokenizerFast.from_pretrained(tmp_path / "bpe"), AutoTokenizer.from_pretrained(tmp_path / "all"),
               PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "all" / "tokenizer.json"))):
        for text in texts:
            assert ours.encode(text) == hf.encode(text), text[:40]
            assert hf.decode(ours.encode(text)) == text
        assert ours.encode(f"a{EOT}b ", allow_special=True) == hf.encode(f"a{EOT}b ") == [64, 50256, 65, 220]
    with pytest.raises(GptlabError, match="special token"):
        ours.encode(f"a{EOT}b")


# ---- fine-tuning -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_vocab_folder(tmp_path_factory):
    """A small random model with GPT-2's 50,257-token vocabulary and no tokenizer files, like a bare download."""
    return hf_folder(tmp_path_factory.mktemp("gpt2") / "tiny-gpt2", seed=7, vocab_size=50257, n_embd=32,
                     n_head=2, n_layer=2, n_positions=64)


@pytest.fixture
def workdir(tmp_path, monkeypatch, corpus_file, capsys, gpt2_vocab_folder):
    monkeypatch.chdir(tmp_path)
    run_ok(capsys, "prepare", str(corpus_file), "--tokenizer", "gpt2", "--out", "data", "--quiet")
    run_ok(capsys, "import", str(gpt2_vocab_folder), "--run", "runs/base")
    return tmp_path


FINETUNE = ["--block-size", "32", "--max-steps", "8", "--batch-size", "4", "--grad-accum", "1", "--lr", "3e-3",
            "--min-lr", "3e-3", "--warmup-steps", "0", "--eval-interval", "8", "--eval-batches", "2",
            "--log-interval", "4", "--precision", "fp32", "--device", "cpu", "--dropout", "0", "--quiet"]


def test_finetune_lowers_the_loss_and_exports_to_transformers(workdir, capsys, gpt2_vocab_folder):
    run_ok(capsys, "train", "--init-from", str(gpt2_vocab_folder), "--data", "data", "--run", "runs/ft", *FINETUNE)
    config = json.loads((workdir / "runs/ft/config.json").read_text())
    assert config["preset"] == "finetune" and config["train"]["init_from"] == str(gpt2_vocab_folder)
    base, tuned = load_run("runs/base").model, load_run("runs/ft").model
    assert tuned.config.block_size == 32 and tuned.config.activation == "gelu_tanh"
    base.crop_block_size(32)  # score both with the same context
    val = load_dataset("data").val
    loss_before, loss_after = (total_nats(m, val)[0] for m in (base, tuned))
    assert loss_after < 0.9 * loss_before

    run_ok(capsys, "export", "runs/ft", "--out", "ft-hf")
    hf = load_hf(workdir / "ft-hf")
    assert hf.config.n_positions == 32 and (workdir / "ft-hf/merges.txt").is_file()
    x = torch.as_tensor(val[:64].astype("int64")).view(2, 32)
    with torch.no_grad():
        assert (tuned(x)[0] - hf(x).logits).abs().max().item() <= 1e-5


def test_init_from_a_run_or_its_hf_folder_gives_the_same_weights(workdir, gpt2_vocab_folder):
    cfg = dataclasses.replace(load_run("runs/base").model_cfg, block_size=24)
    from_run = init_tensors("runs/base", cfg, GPT2Tokenizer())
    from_hf = init_tensors(gpt2_vocab_folder, cfg, GPT2Tokenizer())
    assert from_run.keys() == from_hf.keys() and all(torch.equal(from_run[k], from_hf[k]) for k in from_run)
    assert from_run["transformer.wpe.weight"].shape == (24, 32)


def test_bad_fine_tuning_settings_are_one_clear_line(workdir, capsys, corpus_file):
    line = run_bad(capsys, "train", "--init-from", "runs/base", "--data", "data", "--n-layer", "3", *FINETUNE)
    assert "shape comes from the source" in line and "n_layer=3 (source 2)" in line
    line = run_bad(capsys, "train", "--init-from", "runs/base", "--data", "data", *FINETUNE, "--block-size", "128")
    assert "can only be cut shorter" in line
    run_ok(capsys, "prepare", str(corpus_file), "--out", "chars", "--quiet")
    line = run_bad(capsys, "train", "--init-from", "runs/base", "--data", "chars", *FINETUNE)
    assert "char tokenizer" in line and "--tokenizer gpt2" in line
    assert "--init-from" in run_bad(capsys, "train", "--preset", "finetune", "--data", "data")
    assert "not a gptlab run nor" in run_bad(capsys, "train", "--init-from", "nowhere", "--data", "data")


# ---- bad input -------------------------------------------------------------------------------------------------

def test_bad_checkpoints_are_one_clear_line_each(workdir, capsys, gpt2_vocab_folder):
    def folder(name, config=None, weights=None):
        path = workdir / name
        shutil.copytree(gpt2_vocab_folder, path)
        if config is not None:
            cfg = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**cfg, **config}))
        if weights is not None:
            (path / "model.safetensors").unlink()
            weights(path)
        return name

    (workdir / "empty").mkdir()
    assert "is not a Hugging Face model folder" in run_bad(capsys, "import", "empty")
    assert "does not exist" in run_bad(capsys, "import", "missing")
    assert "not GPT-2" in run_bad(capsys, "import", folder("llama", config={"model_type": "llama"}))
    assert "activation 'relu'" in run_bad(capsys, "import", folder("relu", config={"activation_function": "relu"}))
    scaled = folder("scaled", config={"scale_attn_by_inverse_layer_idx": True})
    assert "variant gptlab does not implement" in run_bad(capsys, "import", scaled)
    line = run_bad(capsys, "import", folder("wide", config={"n_embd": 64}))
    assert "do not fit" in line and "shape mismatch" in line
    assert "no weights" in run_bad(capsys, "import", folder("bare", weights=lambda p: None))
    data = (gpt2_vocab_folder / "model.safetensors").read_bytes()
    truncated = folder("cut", weights=lambda p: (p / "model.safetensors").write_bytes(data[:len(data) // 2]))
    assert "truncated or damaged" in run_bad(capsys, "import", truncated)

    def cut_bin(path):
        torch.save(load_file(gpt2_vocab_folder / "model.safetensors"), path / "pytorch_model.bin")
        blob = (path / "pytorch_model.bin").read_bytes()
        (path / "pytorch_model.bin").write_bytes(blob[:len(blob) // 2])

    assert "truncated or damaged" in run_bad(capsys, "import", folder("cut-bin", weights=cut_bin))
    pickled = folder("pickled", weights=lambda p: torch.save({"w": argparse.Namespace(a=1)},
                                                             p / "pytorch_model.bin"))
    assert "never unpickles" in run_bad(capsys, "import", pickled)
    own = folder("own-tokenizer")
    (workdir / own / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}))
    assert "its own tokenizer" in run_bad(capsys, "import", own)
    assert "already holds a run" in run_bad(capsys, "import", str(gpt2_vocab_folder), "--run", "runs/base")
    line = run_bad(capsys, "sample", "--run", "runs/base", "--prompt", f"Hello{EOT}world")
    assert "special token <|endoftext|>" in line and "--allow-special" in line
    assert run_ok(capsys, "sample", "--run", "runs/base", "--prompt", f"Hi{EOT}", "--allow-special",
                  "--max-new-tokens", "3")
    assert "imported" in run_bad(capsys, "eval", "--run", "runs/base")


# ---- sizes -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_gpt2_presets_have_transformers_parameter_counts(preset):
    cfg = build(ModelConfig, PRESETS[preset].model, {})
    with torch.device("meta"):  # shapes only: no memory, no time
        ours = GPT(cfg)
        hf = GPT2LMHeadModel(GPT2Config(n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head))
    assert ours.num_params() == hf.num_parameters()
    assert ours.num_params(non_embedding=True) == hf.num_parameters(exclude_embeddings=True)
    # (the gpt2 preset's exact 124,439,808 and its FLOPs per token are pinned in test_model.py)
