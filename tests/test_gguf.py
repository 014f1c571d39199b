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
from gptlab.tokenizer import BPETokenizer, CharTokenizer, ChatTokenizer, GPT2Tokenizer, Tokenizer

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
    assert chat.tokens[:-4] == char.tokens and chat.types[:-4] == char.types  # the base's tokens, then the markers
    assert chat.tokens[-4:] == ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    assert chat.types[-4:] == [CONTROL] * 4 and chat.chat_template
    for tokenizer in (GPT2Tokenizer(), CHARS, ChatTokenizer(GPT2Tokenizer()),
                      BPETokenizer.train([GGUF_TEXT * 5], 300)):
        assert from_vocab(to_vocab(tokenizer)).to_dict() == tokenizer.to_dict()

    class Words(Tokenizer):
        kind = "words"

    with pytest.raises(GptlabError, match="a words tokenizer has no GGUF form in this gptlab"):
        to_vocab(Words())


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
    with pytest.raises(GptlabError, match="trained with the exact GELU"):
        export_gguf(run, tmp_path / "m.gguf")  # the default: refused
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


def test_cli_export_import_sample(tmp_path, capsys, shapes, monkeypatch):
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
    monkeypatch.chdir(tmp_path)  # no --run: runs/ and the file's name without .gguf
    assert "into runs/m: " in run_ok(capsys, "import", "gguf", "m.gguf") and (tmp_path / "runs" / "m").is_dir()


def gguf_with(path, arch="gpt2", qtype=Q.F32, tokens=("a", "b")):
    """A hand-made GGUF: one tensor of `qtype`, GPT-2's keys, a two-token vocabulary."""
    w = gguf.GGUFWriter(path, arch)
    for key, value in (("context_length", 8), ("embedding_length", 32), ("block_count", 1),
                       ("attention.head_count", 2)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_epsilon", 1e-5)
    w.add_tokenizer_model("rwkv")
    if tokens:
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
        "q4.gguf": (gguf_with(tmp_path / "q4.gguf", qtype=Q.Q4_0),
                    f"{tmp_path / 'q4.gguf'}: tensor token_embd.weight is Q4_0; gptlab imports " + ", ".join(READ_TYPES)),
        "novocab.gguf": (gguf_with(tmp_path / "novocab.gguf", tokens=()), "has no vocabulary (tokenizer.ggml.tokens)"),
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
    cases["type.gguf"] = (tmp_path / "type.gguf", "250) is not a valid GGMLQuantizationType); gptlab imports F32, F16")
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


def rewritten(path, out, drop=(), keys=None, tensors=None):
    """A copy of the GGUF file at `path` as another program might have written it: the keys in `drop` (prefixes)
    left out, `keys` ({name: (value, gguf.GGUFValueType)}) set, `tensors` ({name: array or None}) replaced, added
    or (None) left out."""
    reader = gguf.GGUFReader(path)
    keys, tensors = keys or {}, dict(tensors or {})
    w = gguf.GGUFWriter(out, "gpt2")
    add = {gguf.GGUFValueType.STRING: w.add_string, gguf.GGUFValueType.FLOAT32: w.add_float32,
           gguf.GGUFValueType.UINT32: w.add_uint32, gguf.GGUFValueType.BOOL: w.add_bool,
           gguf.GGUFValueType.ARRAY: w.add_array}
    for name, f in reader.fields.items():
        if name.startswith(("GGUF.", "general.architecture")) or name.startswith(tuple(drop)) or name in keys:
            continue
        add[f.types[0]](name, f.contents())
    for name, (value, kind) in keys.items():
        add[kind](name, value)
    for t in reader.tensors:
        data = tensors.pop(t.name, np.asarray(t.data))
        if data is not None:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type if data.dtype == np.uint8 else None)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_tensor_of_another_shape_is_refused_naming_the_file(tmp_path, shapes):
    """A file whose tensor does not fit its own hyperparameters: one line naming the file and the tensor."""
    from gptlab.ggml.gguf_in import load_gguf_model

    path = gguf_file(tmp_path / "m.gguf", shapes["48-wide-3-heads"], CHARS)
    up = np.asarray(gguf.GGUFReader(path).get_tensor(0).data)  # any tensor's array, only for its dtype
    wide = np.zeros((4 * 48, 47), dtype=up.dtype)
    rewritten(path, tmp_path / "odd.gguf", tensors={"blk.1.ffn_up.weight": wide})
    with pytest.raises(GptlabError) as error:
        load_gguf_model(tmp_path / "odd.gguf")
    assert str(tmp_path / "odd.gguf") in str(error.value) and "mlp.c_fc.weight" in str(error.value)


def test_a_gguf_another_program_wrote(tmp_path, capsys):
    """Without gptlab's keys (as llama.cpp's converter writes GPT-2): biases on, GELU's tanh form, the tokenizer from
    the file's tokens, types and merges, end of text from its eos id; an output.weight equal to token_embd is the
    tied head (dropped), another one refused; the imported model computes the logits of the model exported."""
    from gptlab.ggml.gguf_in import load_gguf_model

    torch.manual_seed(0)
    tokenizer = BPETokenizer.train([GGUF_TEXT * 5], 300)
    model = perturbed(GPT(tiny_config(vocab_size=tokenizer.vocab_size, n_embd=64, bias=False,
                                      activation="gelu_tanh"))).eval()
    path = gguf_file(tmp_path / "m.gguf", model, tokenizer)
    embd = next(np.asarray(t.data) for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    foreign = rewritten(path, tmp_path / "f.gguf", drop=("gptlab.",), tensors={"output.weight": embd.copy()})
    back, back_tokenizer = load_gguf_model(foreign)
    c = back.config
    assert (c.bias, c.activation, c.dropout, c.vocab_size, c.n_embd, c.n_head, c.n_layer, c.block_size) == \
        (True, "gelu_tanh", 0.0, tokenizer.vocab_size, 64, 2, 2, 16)
    assert back_tokenizer.to_dict() == tokenizer.to_dict() and back_tokenizer.eot_id == tokenizer.eot_id
    x = torch.tensor([tokenizer.encode(GGUF_TEXT)[:16]])
    with torch.no_grad():
        assert torch.equal(back(x)[0], model(x)[0])  # zero biases added: the same sums, the same bits
    no_types = rewritten(path, tmp_path / "t.gguf", drop=("gptlab.", "tokenizer.ggml.token_type"))
    assert load_gguf_model(no_types)[1].encode(GGUF_TEXT) == tokenizer.encode(GGUF_TEXT)  # no control tokens: text
    no_kind = rewritten(path, tmp_path / "k.gguf", drop=("gptlab.", "tokenizer.ggml.model"))
    assert "vocabulary is of kind '' (tokenizer.ggml.model)" in run_bad(capsys, "import", "gguf", str(no_kind))
    untied = rewritten(path, tmp_path / "u.gguf", drop=("gptlab.",), tensors={"output.weight": embd * 2})
    line = run_bad(capsys, "import", "gguf", str(untied), "--run", str(tmp_path / "r"))
    assert f"{untied} has an output.weight that is not tied to token_embd" in line
    # gptlab's key says no biases, a bias that is not zero says otherwise: an edited file
    bias = np.ones(64, np.float32)
    edited = rewritten(path, tmp_path / "e.gguf", tensors={"blk.0.attn_output.bias": bias})
    line = run_bad(capsys, "import", "gguf", str(edited), "--run", str(tmp_path / "r"))
    assert "transformer.h.0.attn.c_proj.bias is not zero, but gptlab.model says the model has no biases" in line
    assert not (tmp_path / "r").exists()


def test_hyperparameters_that_do_not_fit_are_refused(tmp_path, capsys, shapes):
    path = gguf_file(tmp_path / "m.gguf", shapes["48-wide-3-heads"], CHARS)
    U32, F32 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    for name, change, message in (
            ("ffn", {"keys": {"gpt2.feed_forward_length": (100, U32)}},
             "a feed-forward width of 100; gptlab's MLP is always 4 x n_embd (192) wide"),
            ("noffn", {"drop": ("gpt2.feed_forward_length",)}, None),  # absent: 4 x n_embd, as llama.cpp reads it
            ("heads", {"drop": ("gpt2.attention.head_count",)},
             "lacks GPT-2's hyperparameters (context_length, embedding_length, block_count, attention.head_count)"),
            ("eps", {"keys": {"gpt2.attention.layer_norm_epsilon": (1e-3, F32)}},
             "gptlab.model does not describe its own hyperparameters"),
            ("ctx", {"keys": {"gpt2.context_length": (8, U32)}},
             "gptlab.model does not describe its own hyperparameters")):
        odd = rewritten(path, tmp_path / f"{name}.gguf", **change)
        if message is None:
            assert read_gguf(odd)[0].n_embd == 48
            continue
        line = run_bad(capsys, "import", "gguf", str(odd), "--run", str(tmp_path / name))
        assert message in line and str(odd) in line, line
        assert not (tmp_path / name).exists()


def test_the_vocabulary_keys_as_written(tmp_path, shapes):
    """tokenizer.ggml.* read back from the file: the kind, GPT-2's pre-tokenizer and merges for a byte-level BPE
    (none for a char vocabulary), end of text as bos and eos, no BOS added, a chat tokenizer's template; gptlab's
    own tokenizer file as UTF-8 JSON (its characters written as themselves); general.name the run's folder."""
    field = lambda reader, key: None if reader.get_field(key) is None else reader.get_field(key).contents()  # noqa
    model = shapes["48-wide-3-heads"]
    char = gguf.GGUFReader(gguf_file(tmp_path / "char.gguf", model, CHARS))
    assert (field(char, "tokenizer.ggml.model"), field(char, "tokenizer.ggml.pre"),
            field(char, "tokenizer.ggml.merges"), field(char, "tokenizer.ggml.eos_token_id"),
            field(char, "tokenizer.ggml.add_bos_token"), field(char, "tokenizer.chat_template")) == \
        ("rwkv", None, None, None, False, None)
    assert "é" in field(char, GPTLAB_KEY) and field(char, "general.name") == "char-run"
    gpt2_model = perturbed(GPT(tiny_config(vocab_size=50257 + 4, n_embd=32, activation="gelu_tanh")))
    chat = gguf.GGUFReader(gguf_file(tmp_path / "chat.gguf", gpt2_model, ChatTokenizer(GPT2Tokenizer())))
    assert (field(chat, "tokenizer.ggml.model"), field(chat, "tokenizer.ggml.pre"),
            len(field(chat, "tokenizer.ggml.merges")), field(chat, "tokenizer.ggml.bos_token_id"),
            field(chat, "tokenizer.ggml.eos_token_id"), field(chat, "tokenizer.ggml.add_bos_token")) == \
        ("gpt2", "gpt-2", 50000, 50256, 50256, False)
    assert field(chat, "tokenizer.chat_template").startswith("{%- for message in messages -%}")
    assert field(chat, "tokenizer.ggml.token_type")[-5:] == [CONTROL] * 5  # <|endoftext|> and the four markers


def test_the_tensor_types_counted_and_a_failed_write_leaves_nothing(tmp_path, shapes, monkeypatch):
    """48 wide, 2 layers, q8_0: the four matrices of 48-wide rows (qkv, proj, up; and the token table) fall back to
    F16, ffn_down's 192-wide rows quantize, the rest is F32 (vectors and the position table), counted by hand. A
    write that fails (the disk, an interrupt) leaves no file and no temp file."""
    run = model_run(tmp_path / "run", shapes["48-wide-3-heads"], CHARS)
    done = export_gguf(run, tmp_path / "m.gguf", "q8_0")
    assert done.path == tmp_path / "m.gguf" and done.kl is None
    assert done.types == {"f16": 1 + 2 * 3, "q8_0": 2, "f32": 1 + 2 + 2 * 8}
    assert done.bytes == (tmp_path / "m.gguf").stat().st_size
    import errno

    for failure, expected in ((OSError(errno.ENOSPC, "No space left on device"), GptlabError),
                              (KeyboardInterrupt(), KeyboardInterrupt)):
        for step in ("add_name", "write_tensors_to_file"):  # before the file exists, and while it is written
            def fail(*args, failure=failure, **kwargs):
                raise failure

            with monkeypatch.context() as m:
                m.setattr(gguf.GGUFWriter, step, fail)
                with pytest.raises(expected) as error:
                    export_gguf(run, tmp_path / "n.gguf", "q8_0")
            if expected is GptlabError:
                assert str(error.value) == f"cannot write {tmp_path / 'n.gguf'}: No space left on device; check " \
                                           "free space and permissions"
            assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "run"], step


def test_bad_names_and_runs(tmp_path):
    from gptlab.ggml.gguf_in import gptlab_name
    from gptlab.ggml.gguf_out import gguf_name
    from gptlab.model import Bigram

    assert gguf_name("transformer.h.11.mlp.c_proj.bias") == "blk.11.ffn_down.bias"
    assert gptlab_name("blk.11.ffn_down.bias") == "transformer.h.11.mlp.c_proj.bias"
    for name in ("transformer.h.0.attn.bias", "transformer.x.0.ln_1.weight", "transformer.h.0.mlp.weight"):
        with pytest.raises(AssertionError, match=f"no GGUF name for {name}"):
            gguf_name(name)
    for name in ("blk.x.attn_qkv.weight", "zzz.0.attn_qkv.weight", "blk.0.attn_qkv.weight.x", "blk.0.ffn_gate.weight",
                 "output.bias"):
        with pytest.raises(GptlabError, match=f"holds a tensor '{name}' that GPT-2 does not have"):
            gptlab_name(name)
    bigram = model_run(tmp_path / "bigram", Bigram(tiny_config(arch="bigram", vocab_size=CHARS.vocab_size)), CHARS)
    with pytest.raises(GptlabError, match="holds a bigram model; only GPT models"):
        export_gguf(bigram, tmp_path / "b.gguf")
    run = model_run(tmp_path / "run", GPT(tiny_config(vocab_size=CHARS.vocab_size, activation="gelu_tanh")), CHARS)
    with pytest.raises(GptlabError, match="--outtype q4_0: choose one of f32, bf16, q8_0"):
        export_gguf(run, tmp_path / "q.gguf", "q4_0")
    export_gguf(run, tmp_path / "m.gguf")
    with pytest.raises(GptlabError, match="exists; give another --out, or pass --overwrite"):
        export_gguf(run, tmp_path / "m.gguf")  # the default: an existing file stays
    vocab = to_vocab(BPETokenizer.train([GGUF_TEXT * 5], 300))
    vocab.gptlab, vocab.merges = None, vocab.merges[:-1]  # the last merge made the last token: drop both, ...
    vocab.tokens[-1] = vocab.tokens[-2]  # ... and give the last id a token the vocabulary has already
    with pytest.raises(GptlabError, match=f"has {len(vocab.tokens)} tokens, its tokenizer {len(vocab.tokens) - 1}"):
        from_vocab(vocab)
    vocab.merges = [*vocab.merges, "zz qq"]  # a merge of tokens it lacks
    with pytest.raises(GptlabError, match="BPE cannot be built from its tokens and merges .*; the file is damaged"):
        from_vocab(vocab)
