"""GGUF out and in (gptlab.ggml), without llama.cpp: the round trip is bit-exact in f32; bf16 and q8_0 hold what
the `gguf` package's own reader and dequantizer read, and what torch's rounding and a q8_0 block worked out by hand
give; the tensor types, names, shapes and hyperparameters are llama.cpp's GPT-2's (its converter's rules, stated
here); the vocabulary is written as llama.cpp reads it; bad input gets one line and nothing written.
The checks against llama.cpp itself are in tests/test_llamacpp.py (`make peers`)."""

import struct

import gguf
import numpy as np
import pytest
import torch

from helpers import GGUF_TEXT, TINY, model_run, perturbed, run_bad, run_ok, tiny_config, tiny_run, tree
from gptlab import checkpoint as ck
from gptlab import rundir
from gptlab.checkpoint import load_run
from gptlab.errors import GptlabError
from gptlab.ggml.gguf_in import READ_TYPES, import_gguf, read_gguf
from gptlab.ggml.gguf_out import OUTTYPES, Q8_BLOCK, export_gguf, tensor_type
from gptlab.ggml.vocab import CONTROL, GPTLAB_KEY, NORMAL, escape_char, from_vocab, to_vocab, unescape_token
from gptlab.model import GPT
from gptlab.tokenizer import BPETokenizer, CharTokenizer, ChatTokenizer, GPT2Tokenizer

Q = gguf.GGMLQuantizationType
CHARS = CharTokenizer(GGUF_TEXT + "\r\x01\x7f")


def gguf_file(path, model, tokenizer, outtype="f32", **kw):
    run = model_run(path.parent / f"{path.stem}-run", model, tokenizer)
    export_gguf(run, path, outtype, **kw)
    return path


def tensors_of(path):
    """{name: (type name, ggml shape, fp32 values by the gguf package's own dequantizer)}."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = (t.tensor_type.name, [int(n) for n in t.shape], np.asarray(values, np.float32))
    return out, reader


@pytest.fixture(scope="module")
def shapes():
    """Models off their init: odd widths (48: rows of 1.5 q8_0 blocks), no biases, another epsilon, exact GELU."""
    torch.manual_seed(0)
    return {
        "48-wide-3-heads": perturbed(GPT(tiny_config(vocab_size=CHARS.vocab_size, n_embd=48, n_head=3,
                                                     activation="gelu_tanh"))),
        "64-wide-no-bias-eps-1e-4": perturbed(GPT(tiny_config(vocab_size=CHARS.vocab_size + 3, n_embd=64,
                                                              bias=False, layer_norm_eps=1e-4,
                                                              activation="gelu_tanh"))),
    }


@pytest.mark.parametrize("name", ["48-wide-3-heads", "64-wide-no-bias-eps-1e-4"])
def test_f32_round_trip_is_bit_exact(tmp_path, shapes, name):
    model = shapes[name]
    path = gguf_file(tmp_path / "m.gguf", model, CHARS)
    cfg, tensors, tokenizer = read_gguf(path)
    ours = ck.model_tensors(model)
    ours["transformer.wte.weight"] = ours["transformer.wte.weight"][:CHARS.vocab_size]  # the padded rows stay home
    assert set(tensors) == set(ours)
    for k in ours:
        assert torch.equal(tensors[k], ours[k]), k
    assert cfg.bias == model.config.bias and cfg.layer_norm_eps == model.config.layer_norm_eps
    assert (cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.block_size, cfg.vocab_size) == \
        (model.config.n_embd, model.config.n_head, model.config.n_layer, model.config.block_size, CHARS.vocab_size)
    assert tokenizer.to_dict() == CHARS.to_dict()


def test_the_file_is_llama_cpps_gpt2(tmp_path, shapes):
    """Names, ggml shapes (first dimension the input), types and keys as llama.cpp's GPT-2 loader asks for them."""
    model = shapes["64-wide-no-bias-eps-1e-4"]
    path = gguf_file(tmp_path / "m.gguf", model, CHARS, "q8_0")
    tensors, reader = tensors_of(path)
    C, V, T = 64, CHARS.vocab_size, model.config.block_size
    want = {"token_embd.weight": ("Q8_0", [C, V]), "position_embd.weight": ("F32", [C, T]),
            "output_norm.weight": ("F32", [C]), "output_norm.bias": ("F32", [C])}
    for i in range(2):
        want |= {f"blk.{i}.attn_norm.weight": ("F32", [C]), f"blk.{i}.attn_norm.bias": ("F32", [C]),
                 f"blk.{i}.attn_qkv.weight": ("Q8_0", [C, 3 * C]), f"blk.{i}.attn_qkv.bias": ("F32", [3 * C]),
                 f"blk.{i}.attn_output.weight": ("Q8_0", [C, C]), f"blk.{i}.attn_output.bias": ("F32", [C]),
                 f"blk.{i}.ffn_norm.weight": ("F32", [C]), f"blk.{i}.ffn_norm.bias": ("F32", [C]),
                 f"blk.{i}.ffn_up.weight": ("Q8_0", [C, 4 * C]), f"blk.{i}.ffn_up.bias": ("F32", [4 * C]),
                 f"blk.{i}.ffn_down.weight": ("Q8_0", [4 * C, C]), f"blk.{i}.ffn_down.bias": ("F32", [C])}
    assert {k: v[:2] for k, v in tensors.items()} == want
    assert not tensors["blk.0.attn_qkv.bias"][2].any()  # no biases in the run: zeros, which llama.cpp requires
    field = lambda key: reader.get_field(key).contents()
    assert field("general.architecture") == "gpt2" and field("general.file_type") == 7
    assert (field("gpt2.context_length"), field("gpt2.embedding_length"), field("gpt2.feed_forward_length"),
            field("gpt2.block_count"), field("gpt2.attention.head_count")) == (T, C, 4 * C, 2, 2)
    assert field("gpt2.attention.layer_norm_epsilon") == pytest.approx(1e-4)
    assert field("tokenizer.ggml.add_bos_token") is False
    assert reader.get_field("output.weight") is None  # the head is tied: llama.cpp reads token_embd


def test_tensor_types_follow_llama_cpps_converter():
    """Vectors, norms, biases and the position table stay F32; q8_0 rows that are no whole number of 32-weight
    blocks fall back to F16 (convert_hf_to_gguf.py's rules)."""
    m64, m48 = np.zeros((8, 64)), np.zeros((8, 48))
    assert [tensor_type("blk.0.ffn_up.weight", m64, t) for t in OUTTYPES] == ["f32", "bf16", "q8_0"]
    assert tensor_type("blk.0.ffn_up.weight", m48, "q8_0") == "f16"
    assert tensor_type("blk.0.ffn_up.weight", np.zeros((8, Q8_BLOCK + 1)), "q8_0") == "f16"
    assert tensor_type("blk.0.ffn_up.weight", m48, "bf16") == "bf16"
    assert tensor_type("position_embd.weight", m64, "q8_0") == "f32"
    assert tensor_type("blk.0.attn_norm.weight", np.zeros(64), "q8_0") == "f32"
    assert tensor_type("blk.0.ffn_up.bias", np.zeros(64), "bf16") == "f32"
    assert tensor_type("token_embd.weight", m64, "q8_0") == "q8_0"


@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_bf16_and_q8_0_import_as_the_gguf_package_dequantizes(tmp_path, shapes, outtype):
    model = shapes["48-wide-3-heads"]
    path = gguf_file(tmp_path / "m.gguf", model, CHARS, outtype)
    tensors, _ = tensors_of(path)
    _, imported, _ = read_gguf(path)
    from gptlab.ggml.gguf_in import gptlab_name

    kinds = set()
    for name, (kind, shape, values) in tensors.items():
        kinds.add(kind)
        got = imported[gptlab_name(name)].numpy()
        assert np.array_equal(got.reshape(-1), values.reshape(-1)), name
        own = ck.model_tensors(model)[gptlab_name(name)].numpy()[:shape[-1] if len(shape) > 1 else None]
        if kind == "BF16":  # torch's round-to-nearest-even, from outside the gguf package
            assert np.array_equal(got, torch.from_numpy(own).bfloat16().float().numpy()), name
        elif kind == "F16":
            assert np.array_equal(got, own.astype(np.float16).astype(np.float32)), name
        elif kind == "F32":
            assert np.array_equal(got, own), name
        else:  # q8_0: within half a step d = max|w| / 127 of each block, plus 127 x the step's fp16 rounding
            blocks = own.reshape(-1, Q8_BLOCK)
            step = np.abs(blocks).max(1, keepdims=True) / 127
            bound = 0.5 * step + 127 * np.abs(step - step.astype(np.float16)) + 1e-7
            assert (np.abs(got.reshape(-1, Q8_BLOCK) - blocks) <= bound).all(), name
    # n_embd 48: the matrices whose rows are 48 wide fall back to F16; ffn_down's rows are 192 = 6 blocks
    assert kinds == ({"BF16", "F32"} if outtype == "bf16" else {"Q8_0", "F16", "F32"})


def test_q8_0_block_worked_out_by_hand():
    """One 32-weight block whose largest |w| is 127/128: the fp16 scale is 1/128 exactly, and each weight x 128 is
    rounded half away from zero (ggml's roundf; round-half-even would give 0, -2, 2, -64 for the halves)."""
    from gptlab.ggml.gguf_out import encoded

    w = np.zeros((1, Q8_BLOCK), np.float32)
    w[0, :6] = np.array([127, 0.5, -1.5, 2.5, -63.5, -0.49]) / 128
    data, qtype = encoded(w, "q8_0")
    assert qtype == Q.Q8_0 and data.shape == (1, 2 + Q8_BLOCK)  # one fp16 scale, 32 int8 weights
    assert data[0, :2].view(np.float16)[0] == np.float16(1 / 128)
    assert data[0, 2:].view(np.int8).tolist() == [127, 1, -2, 3, -64, 0] + [0] * 26


def test_vocabularies_as_llama_cpp_reads_them():
    gpt2 = to_vocab(GPT2Tokenizer())
    assert (gpt2.model, len(gpt2.tokens), len(gpt2.merges), gpt2.eot_id) == ("gpt2", 50257, 50000, 50256)
    assert gpt2.tokens[50256] == "<|endoftext|>" and gpt2.types[50256] == CONTROL and gpt2.types[0] == NORMAL
    assert gpt2.tokens[220] == "Ġ" and gpt2.merges[0] == "Ġ t"  # a space in GPT-2's byte alphabet; the first merge
    char = to_vocab(CHARS)
    assert char.model == "rwkv" and char.eot_id is None and char.merges == []
    assert [unescape_token(t).decode() for t in char.tokens] == CHARS.chars
    chat = to_vocab(ChatTokenizer(CHARS))
    assert chat.tokens[-4:] == ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    assert chat.types[-4:] == [CONTROL] * 4 and chat.chat_template
    for tokenizer in (GPT2Tokenizer(), CHARS, ChatTokenizer(GPT2Tokenizer()),
                      BPETokenizer.train([GGUF_TEXT * 5], 300)):
        assert from_vocab(to_vocab(tokenizer)).to_dict() == tokenizer.to_dict()


def test_rwkv_escapes_worked_out_by_hand():
    assert [escape_char(c) for c in "\\\n\t\r\x01\x7f é日"] == ["\\\\", "\\n", "\\t", "\\r", "\\x01", "\\x7f", " ",
                                                               "é", "日"]
    assert unescape_token("\\\\") == b"\\" and unescape_token("\\x1f") == b"\x1f" and unescape_token("é") == "é".encode()
    for ch in map(chr, [*range(0x80), 0xE9, 0x65E5, 0x1F600]):
        assert unescape_token(escape_char(ch)) == ch.encode()
    # several escapes in one token, as llama.cpp's unescaping reads them; a backslash at the end is dropped there
    assert unescape_token("ab\\x41c\\nd\\\\e\\tz\\r\\x7f") == b"abAc\nd\\e\tz\r\x7f"
    assert unescape_token("é\\x1f日\\q") == "é".encode() + b"\x1f" + "日".encode() + b"q"
    assert unescape_token("end\\") == b"end" and unescape_token("") == b""


def test_a_foreign_vocabulary_without_gptlabs_key():
    """A GGUF someone else wrote: GPT-2's own vocabulary, a byte-level BPE (its special tokens special), a char
    vocabulary: each the very tokenizer it came from; anything else refused in one line."""
    for tokenizer, kind in ((GPT2Tokenizer(), "gpt2"), (BPETokenizer.train([GGUF_TEXT * 5], 300), "bpe"),
                            (CHARS, "char")):
        vocab = to_vocab(tokenizer)
        vocab.gptlab = None
        back = from_vocab(vocab)
        assert back.kind == kind and back.to_dict() == tokenizer.to_dict()
        assert back.decode(back.encode(GGUF_TEXT)) == GGUF_TEXT
    bpe = to_vocab(BPETokenizer.train([GGUF_TEXT * 5], 300))
    bpe.gptlab = None
    bpe.tokens[0], bpe.types[0] = "<|a token|>", CONTROL  # a control token may hold any character
    assert from_vocab(bpe).encode("x<|a token|>", allow_special=True)[-1] == 0
    for odd in ("a b", "日"):  # a normal token outside GPT-2's byte alphabet
        bad = to_vocab(BPETokenizer.train([GGUF_TEXT * 5], 300))
        bad.gptlab, bad.tokens[-1] = None, odd
        with pytest.raises(GptlabError, match=f"token {odd!r} is not in GPT-2's byte alphabet"):
            from_vocab(bad)
    vocab = to_vocab(CHARS)
    vocab.gptlab, vocab.model = None, "llama"
    with pytest.raises(GptlabError, match="kind 'llama'"):
        from_vocab(vocab)
    for tokens in (vocab.tokens[::-1], ["a", "bc"], ["a", "\\xff"], []):  # unsorted, two characters, no UTF-8
        vocab.model, vocab.tokens = "rwkv", tokens
        with pytest.raises(GptlabError, match="sorted order"):
            from_vocab(vocab)


def test_exact_gelu_is_refused_or_approximated_with_its_kl(tmp_path, capsys):
    torch.manual_seed(1)
    model = perturbed(GPT(tiny_config(vocab_size=CHARS.vocab_size, activation="gelu")))
    with torch.no_grad():
        for block in model.transformer.h:  # the MLPs' inputs of order 1, where the two forms part most
            block.mlp.c_fc.weight.mul_(10)
    run = model_run(tmp_path / "run", model, CHARS)
    line = run_bad(capsys, "export", str(run), "--format", "gguf", "--out", str(tmp_path / "m.gguf"))
    assert "--activation gelu_tanh" in line and "--approximate-gelu" in line
    assert not (tmp_path / "m.gguf").exists()
    out = run_ok(capsys, "export", str(run), "--format", "gguf", "--out", str(tmp_path / "m.gguf"),
                 "--approximate-gelu")
    done = export_gguf(run, tmp_path / "again.gguf", approximate_gelu=True)
    # the KL worked out here in float64: the model's exact GELU against the tanh form on the same windows
    from gptlab.ggml.gelu import sampled_windows

    windows = sampled_windows(load_run(run), model.config.block_size)
    exact = model.double()
    with torch.no_grad():
        p = torch.log_softmax(exact(torch.tensor(windows))[0], -1)
        for block in exact.transformer.h:
            block.mlp.gelu.approximate = "tanh"
        q = torch.log_softmax(exact(torch.tensor(windows))[0], -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert done.kl == pytest.approx(kl, rel=1e-6) and kl > 0  # float64: the tiny divergence is no rounding
    assert f"{done.kl:.3g}" in out and "the model wrote" in done.kl_text
    cfg, _, _ = read_gguf(tmp_path / "m.gguf")
    assert cfg.activation == "gelu"  # gptlab's own file imports back as the run it came from


def test_cli_export_import_sample(tmp_path, capsys, shapes):
    run = model_run(tmp_path / "run", shapes["48-wide-3-heads"], CHARS)
    out = run_ok(capsys, "export", str(run), "--format", "gguf", "--outtype", "q8_0", "--out",
                 str(tmp_path / "m.gguf"))
    assert "Q8_0" in out and "llama" in out
    out = run_ok(capsys, "import", "gguf", str(tmp_path / "m.gguf"), "--run", str(tmp_path / "back"))
    assert "GELU gelu_tanh" in out
    source = str((tmp_path / "m.gguf").resolve())  # where the weights came from, in the run and its checkpoint
    assert rundir.read_run_config(tmp_path / "back")["imported_from"] == source
    assert load_run(tmp_path / "back").state.imported_from == source
    run_ok(capsys, "sample", "--run", str(tmp_path / "back"), "--max-new-tokens", "5", "--prompt", "First")
    out = run_ok(capsys, "import", str(tmp_path / "m.gguf"), "--run", str(tmp_path / "back2"))  # by its suffix
    assert "imported" in out


def gguf_with(path, arch="gpt2", qtype=Q.F32, tokens=("a", "b")):
    """A hand-made GGUF: one tensor of `qtype`, GPT-2's keys, a two-token vocabulary."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in (("context_length", 8), ("embedding_length", 32), ("block_count", 1),
                       ("attention.head_count", 2)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-5)
    w.add_tokenizer_model("rwkv")
    w.add_token_list(list(tokens))
    data = gguf.quants.quantize(np.ones((2, 32), np.float32), qtype)
    w.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_get_one_line_and_nothing_written(tmp_path, capsys, shapes):
    good = gguf_file(tmp_path / "m.gguf", shapes["48-wide-3-heads"], CHARS)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:good.stat().st_size // 2])
    bad_type = bytearray(good.read_bytes())
    (tmp_path / "notgguf.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    cases = {
        "llama.gguf": (gguf_with(tmp_path / "llama.gguf", arch="llama"), "'llama' model, not GPT-2"),
        "q4.gguf": (gguf_with(tmp_path / "q4.gguf", qtype=Q.Q4_0), "is Q4_0; gptlab imports " + ", ".join(READ_TYPES)),
        "cut.gguf": (cut, "truncated or damaged"),
        "notgguf.gguf": (tmp_path / "notgguf.gguf", "not a GGUF file"),
        "missing.gguf": (tmp_path / "missing.gguf", "does not exist"),
    }
    # an unknown quantization type: the first tensor's type id (after its name, dims and shape) set to 250
    reader = gguf.GGUFReader(good)
    first = reader.tensors[0]
    offset = first.field.offset + 8 + len(first.name) + 4 + 8 * len(first.shape)
    assert struct.unpack_from("<I", bad_type, offset)[0] == first.tensor_type.value
    struct.pack_into("<I", bad_type, offset, 250)
    (tmp_path / "type.gguf").write_bytes(bytes(bad_type))
    cases["type.gguf"] = (tmp_path / "type.gguf", "truncated or damaged")
    for name, (path, message) in cases.items():
        before = tree(tmp_path)
        line = run_bad(capsys, "import", "gguf", str(path), "--run", str(tmp_path / "r" / name))
        assert message in line, (name, line)
        assert tree(tmp_path) == before, name


def test_bad_exports_get_one_line_and_nothing_written(tmp_path, capsys, shapes):
    run = model_run(tmp_path / "run", shapes["48-wide-3-heads"], CHARS)
    (tmp_path / "there.gguf").write_bytes(b"x")
    for argv, message in ((["--out", str(tmp_path)], "is a folder"),
                          (["--out", str(tmp_path / "there.gguf")], "--overwrite"),
                          (["--out", str(tmp_path / "no" / "m.gguf")], "does not exist"),
                          (["--out", str(tmp_path / "m.bin")], "should end in .gguf"),
                          (["--out", str(tmp_path / "m.gguf"), "--merge"], "drop --merge")):
        before = tree(tmp_path)
        assert message in run_bad(capsys, "export", str(run), "--format", "gguf", *argv)
        assert tree(tmp_path) == before
    assert "for --format gguf" in run_bad(capsys, "export", str(run), "--out", str(tmp_path / "hf"), "--outtype",
                                          "q8_0")
    run_ok(capsys, "export", str(run), "--format", "gguf", "--out", str(tmp_path / "there.gguf"), "--overwrite")
    assert read_gguf(tmp_path / "there.gguf")[2].to_dict() == CHARS.to_dict()


def test_an_edited_gptlab_key_is_caught(tmp_path, shapes):
    path = gguf_file(tmp_path / "m.gguf", shapes["48-wide-3-heads"], CHARS)
    raw = path.read_bytes()
    at = raw.index(GPTLAB_KEY.encode())
    assert "é".encode() in raw[at:]
    edited = raw[:at] + raw[at:].replace("é".encode(), "è".encode(), 1)  # same length: the file stays whole
    (tmp_path / "e.gguf").write_bytes(edited)
    with pytest.raises(GptlabError, match="edited"):
        import_gguf(tmp_path / "e.gguf", tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_the_gelu_kl_of_a_trained_run_is_measured_on_its_validation_text(tmp_path):
    """KL_WINDOWS windows of min(context, KL_TOKENS) ids spread evenly over the val split, first to last; the
    KL worked out here in float64 with the run's model and its tanh twin."""
    from gptlab.data.batches import load_dataset
    from gptlab.ggml.gelu import KL_TOKENS, KL_WINDOWS

    run = tiny_run(tmp_path, 5, TINY)  # the exact GELU, gptlab's default
    done = export_gguf(run, tmp_path / "m.gguf", approximate_gelu=True)
    assert "validation text" in done.kl_text and f"{KL_WINDOWS} windows of 16 tokens" in done.kl_text
    val = np.asarray(load_dataset(tmp_path / "data").val)
    length = min(16, KL_TOKENS)
    starts = [round(i * (len(val) - length) / (KL_WINDOWS - 1) - 0.5 + 1e-9) for i in range(KL_WINDOWS)]
    assert starts[0] == 0 and starts[-1] == len(val) - length
    x = torch.tensor(np.stack([val[s:s + length] for s in starts]).astype(np.int64))
    model = load_run(run).model.double()
    with torch.no_grad():
        p = torch.log_softmax(model(x)[0], -1)
        for block in model.transformer.h:
            block.mlp.gelu.approximate = "tanh"
        q = torch.log_softmax(model(x)[0], -1)
    assert done.kl == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-6)
    assert done.agree == pytest.approx((p.argmax(-1) == q.argmax(-1)).double().mean().item())


def test_the_validation_windows_and_when_there_are_none(monkeypatch, tmp_path):
    """Windows spread evenly from the split's start to its end (starts worked out by hand); a split one token
    shorter than a window, or of another tokenizer, or a run without a data folder: none."""
    import types

    import gptlab.data.batches
    from gptlab.ggml import gelu

    run = model_run(tmp_path / "run", GPT(tiny_config(vocab_size=CHARS.vocab_size)), CHARS)
    loaded = load_run(run)
    assert gelu.validation_windows(run, loaded, 16) is None  # an imported run has no data folder
    rundir_config = tmp_path / "run" / "config.json"
    import json

    config = json.loads(rundir_config.read_text())
    rundir_config.write_text(json.dumps({**config, "data": str(tmp_path / "data")}))
    for length, tokenizer, want in ((86, CHARS, [0, 10, 20, 30, 40, 50, 60, 70]), (156, CHARS, [0] * 8),
                                    (155, CHARS, None), (86, GPT2Tokenizer(), None)):
        val = np.arange(156)  # 156 ids: windows of 86 start at 0, 10, ..., 70
        fake = types.SimpleNamespace(val=val, tokenizer=tokenizer)
        monkeypatch.setattr(gptlab.data.batches, "load_dataset", lambda folder: fake)
        got = gelu.validation_windows(run, loaded, length if length != 155 else 157)
        if want is None:
            assert got is None
        else:
            assert got == [list(range(s, s + length)) for s in want]
    monkeypatch.setattr(gptlab.data.batches, "load_dataset", lambda folder: (_ for _ in ()).throw(
        GptlabError("gone")))
    assert gelu.validation_windows(run, loaded, 16) is None


def test_the_text_the_model_writes_when_its_data_is_gone(tmp_path):
    """KL_WINDOWS windows of `length` ids, each from the end-of-text id (id 0 for a vocabulary without one), drawn
    at temperature 1 with seed KL_SEED: what the engine draws with those settings."""
    from gptlab.config import SampleConfig
    from gptlab.engine import generate_batch
    from gptlab.ggml.gelu import KL_SEED, KL_WINDOWS, sampled_windows

    for tokenizer in (CHARS, GPT2Tokenizer()):
        torch.manual_seed(0)
        model = GPT(tiny_config(vocab_size=tokenizer.vocab_size)).eval()
        loaded = load_run(model_run(tmp_path / tokenizer.kind, model, tokenizer))
        first = 0 if tokenizer.eot_id is None else 50256
        windows = sampled_windows(loaded, 12)
        cfg = SampleConfig(max_new_tokens=11, temperature=1.0, seed=KL_SEED)
        drawn = list(zip(*generate_batch(loaded.model, [[first]], cfg, num_samples=KL_WINDOWS)))
        assert windows == [[first, *row] for row in drawn] and len(windows) == KL_WINDOWS
        assert all(len(w) == 12 for w in windows) and len({tuple(w) for w in windows}) > 1


def test_a_tensor_of_another_shape_is_refused_naming_the_file(tmp_path, shapes):
    """A file whose tensor does not fit its own hyperparameters: one line naming the file and the tensor."""
    from gptlab.ggml.gguf_in import load_gguf_model

    path = gguf_file(tmp_path / "m.gguf", shapes["48-wide-3-heads"], CHARS)
    reader = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(tmp_path / "odd.gguf", "gpt2")
    for name, f in reader.fields.items():
        if name.startswith(("gpt2.", "tokenizer.", "gptlab.")) and name != "gpt2.block_count":
            kind = f.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                w.add_array(name, f.contents())
            elif kind == gguf.GGUFValueType.STRING:
                w.add_string(name, f.contents())
            elif kind == gguf.GGUFValueType.FLOAT32:
                w.add_float32(name, f.contents())
            else:
                w.add_uint32(name, f.contents())
    w.add_uint32("gpt2.block_count", 2)
    for t in reader.tensors:
        data = np.asarray(t.data)
        w.add_tensor(t.name, data[:, :-1].copy() if t.name == "blk.1.ffn_up.weight" else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GptlabError) as error:
        load_gguf_model(tmp_path / "odd.gguf")
    assert str(tmp_path / "odd.gguf") in str(error.value) and "mlp.c_fc.weight" in str(error.value)
