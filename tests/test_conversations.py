"""Conversations: the chat template renders the ids transformers' apply_chat_template renders (GPT-2's, a char and a
trained BPE tokenizer, non-ASCII text); `prepare --chat` writes a mask that trains on the assistant's tokens alone
(checked against ids and masks written out by hand), holds out whole conversations, splits a long one before a user
turn keeping its system message, and refuses bad input in one line naming file and line, writing nothing; rows of
conversations start at one and train only on whole ones; the loss ignores the user's targets and is the mean over a
step's lessons across micro-batches; fine-tuning grows the vocabulary by the markers (rows at the mean)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import CORPUS, run_bad, run_ok, tree

from gptlab.chat import check_messages, fit_context
from gptlab.config import ModelConfig, PrepareConfig, TrainConfig
from gptlab.data.batches import batch_generator, get_chat_batch, load_dataset
from gptlab.data.prepare import prepare
from gptlab.errors import GptlabError
from gptlab.hf.hf_tokenizer import write_tokenizer_files
from gptlab.model import GPT
from gptlab.tokenizer import CHAT_TEMPLATE, BPETokenizer, CharTokenizer, ChatTokenizer, GPT2Tokenizer, from_dict
from gptlab.training.step import StepContext, train_step

CONVERSATIONS = [
    [{"role": "system", "content": "Réponds brièvement."}, {"role": "user", "content": "  deux mots\n"},
     {"role": "assistant", "content": "d'accord — ok"}],
    [{"role": "user", "content": "Ünïcode? 漢字"}, {"role": "assistant", "content": "yes: 漢字"},
     {"role": "user", "content": "and again"}, {"role": "assistant", "content": " again"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "empty question"}],
]


def write_jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}, ensure_ascii=False) + "\n" for m in conversations),
                    encoding="utf-8")
    return path


def every_text(conversations):
    return "".join(m["content"] for c in conversations for m in c)


@pytest.fixture(scope="module")
def tokenizers():
    text = every_text(CONVERSATIONS)
    return {"gpt2": ChatTokenizer(GPT2Tokenizer()), "char": ChatTokenizer(CharTokenizer(text)),
            "bpe": ChatTokenizer(BPETokenizer.train([text * 5, CORPUS], 300))}


@pytest.mark.parametrize("kind", ["gpt2", "char", "bpe"])
def test_gptlab_renders_the_ids_that_transformers_apply_chat_template_renders(tmp_path, tokenizers, kind):
    from transformers import AutoTokenizer

    tok = tokenizers[kind]
    write_tokenizer_files(tmp_path, tok, 128)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for messages in CONVERSATIONS:
        for end, prompt in ((len(messages), False), (len(messages) - 1, True)):
            theirs = hf.apply_chat_template(messages[:end], tokenize=True, add_generation_prompt=prompt)
            theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs
            assert tok.render(messages[:end], add_generation_prompt=prompt)[0] == list(theirs)
    assert [hf.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")] == \
        list(range(tok.base.vocab_size, tok.base.vocab_size + 4))


def test_the_rendered_text_is_the_jinja_template_s_and_decodes_back(tokenizers):
    import jinja2

    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    for tok in tokenizers.values():
        for messages in CONVERSATIONS:
            text = template.render(messages=messages, add_generation_prompt=True)
            assert tok.decode(tok.render(messages, add_generation_prompt=True)[0]) == text
    assert template.render(messages=CONVERSATIONS[2], add_generation_prompt=False) == \
        "<|user|><|end|><|assistant|>empty question<|end|>"  # by hand


def test_a_message_holding_a_chat_marker_or_end_of_text_is_refused_not_read_as_one(tokenizers):
    for tok in tokenizers.values():
        with pytest.raises(GptlabError, match="<\\|user\\|>"):
            tok.render([{"role": "user", "content": "say <|user|> now"}])
    with pytest.raises(GptlabError, match="endoftext"):
        tokenizers["gpt2"].render([{"role": "user", "content": "a<|endoftext|>"}])


def test_the_tokenizer_file_keeps_the_template_and_refuses_another(tokenizers):
    data = json.loads(json.dumps(tokenizers["char"].to_dict()))
    again = from_dict(data)
    assert isinstance(again, ChatTokenizer) and again.render(CONVERSATIONS[0]) == tokenizers["char"].render(
        CONVERSATIONS[0])
    data["chat"]["template"] = data["chat"]["template"].replace("<|end|>", "\n")
    with pytest.raises(GptlabError, match="chat template"):
        from_dict(data)


def test_messages_are_checked_for_every_door():
    assert check_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                       "text": "b"}]}]) == \
        [{"role": "user", "content": "ab"}]
    for bad, words in (([], "non-empty"), ([{"role": "robot", "content": "x"}], "unknown role 'robot'"),
                       ([{"role": "user"}], "no content"), (["hi"], "not an object"),
                       ([{"role": "user", "content": 3}], "not text")):
        with pytest.raises(GptlabError, match=words):
            check_messages(bad, "here")
    with pytest.raises(GptlabError, match="ends on a user turn"):
        check_messages([{"role": "user", "content": "q"}], "f:3", training=True)


def test_the_oldest_whole_turns_are_dropped_to_fit_and_the_system_message_stays():
    tok = ChatTokenizer(CharTokenizer("abcdefgh"))
    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": "abc"},
                {"role": "assistant", "content": "abcd"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    # lengths by hand: system 4, user "abc" 5, assistant "abcd" 6, then 3 + 3 + 3, and the prompt's 1: 25 in all
    assert fit_context(messages, tok, 25) == (messages, 0)
    assert fit_context(messages, tok, 24) == ([messages[0]] + messages[3:], 2)
    assert fit_context(messages, tok, 8) == ([messages[0], messages[5]], 4)
    with pytest.raises(GptlabError, match="system messages and last turn"):
        fit_context(messages, tok, 7)


# ---- prepare --chat ----------------------------------------------------------------------------------------------

def by_hand(chars, messages):
    """The ids and mask of a conversation over CharTokenizer(chars) + markers, spelled out: each message is its
    role's marker, its characters and the end marker; the assistant's characters and end marker are trained."""
    vocab = sorted(set(chars))
    marker = {"system": len(vocab), "user": len(vocab) + 1, "assistant": len(vocab) + 2}
    ids, mask = [], []
    for m in messages:
        body = [vocab.index(c) for c in m["content"]] + [len(vocab) + 3]
        ids += [marker[m["role"]]] + body
        mask += [0] + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def test_prepare_chat_writes_the_ids_and_trains_only_the_assistant_s_tokens(tmp_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 4)
    out = run_ok(capsys, "prepare", "--chat", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "d"),
                 "--val-fraction", "0.3")
    assert "8 + 4 conversations" in out  # round(12 x 0.3) = 4 held out
    ds = load_dataset(tmp_path / "d")
    chars = every_text(CONVERSATIONS)
    expected = [by_hand(chars, m) for m in CONVERSATIONS * 4]
    seen = []
    for split in ("train", "val"):
        tokens, (mask, starts) = np.asarray(ds.split(split)), ds.chat[split]
        for a, b in zip(starts[:-1], starts[1:]):
            seen.append((tokens[a:b].tolist(), mask[a:b].tolist()))
    assert sorted(seen) == sorted(expected)
    assert len(ds.chat["val"][1]) - 1 == 4 and ds.tokenizer.vocab_size == len(set(chars)) + 4
    assert ds.meta["chat"]["conversations"] == {"train": 8, "val": 4}


def test_chat_loss_all_trains_every_token(tmp_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    run_ok(capsys, "prepare", "--chat", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "d"), "--chat-loss", "all")
    ds = load_dataset(tmp_path / "d")
    assert set(np.asarray(ds.chat["train"][0]).tolist()) == {1}
    assert ds.meta["chat"]["conversations"] == {"train": 5, "val": 1}  # round(6 x 0.1) = 1: at least one held out


def test_a_prepare_that_fails_while_moving_its_files_in_leaves_no_meta_json(tmp_path, monkeypatch):
    """meta.json is moved in last: a folder it is missing from is never taken for prepared data."""
    import os

    from gptlab.data import conversations

    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    moved = []

    def replace(src, dst):
        if Path(dst).parent == tmp_path / "d":  # moving in, not the staging folder's own atomic writes
            if moved:
                raise OSError(28, "No space left on device")
            moved.append(dst)
        os.rename(src, dst)

    monkeypatch.setattr(conversations.os, "replace", replace)
    with pytest.raises(GptlabError, match="No space left"):
        prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", PrepareConfig(chat=True), quiet=True)
    assert len(moved) == 1 and not (tmp_path / "d" / "meta.json").exists()


def test_a_long_conversation_is_split_before_a_user_turn_each_piece_keeping_the_system_message(tmp_path):
    system = {"role": "system", "content": "sys"}
    turns = [{"role": r, "content": c} for q in ("ab", "cd", "ef") for r, c in (("user", q), ("assistant", q[::-1]))]
    write_jsonl(tmp_path / "c.jsonl", [[system] + turns, turns[:2]])
    chars = "sysabcdef"
    # by hand: system 5 ids, each exchange 8 (user 4 + assistant 4): 29 in all; a context of 21 holds the system
    # message and two exchanges, so the pieces are [system, 1, 2] and [system, 3]
    cfg = PrepareConfig(chat=True, context=21, val_fraction=0.5, tokenizer="char")
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", cfg, quiet=True)
    ds = load_dataset(tmp_path / "d")
    pieces = []
    for split in ("train", "val"):
        tokens, (mask, starts) = np.asarray(ds.split(split)), ds.chat[split]
        pieces += [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]
    assert sorted(pieces) == sorted([by_hand(chars, [system] + turns[:4]), by_hand(chars, [system] + turns[4:]),
                                     by_hand(chars, turns[:2])])
    assert ds.meta["chat"]["longest"] == 21


BAD = [
    ('{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}', "unknown role"),
    ('{"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}', "no content"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "ends on a user turn"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "' + "y" * 70 + '"}]}',
     "assistant turn of 72 tokens, is longer than the context"),
    ('{"messages": [{"role": "user", "content": "' + "x" * 70 + '"}, {"role": "assistant", "content": "y"}]}',
     "longer than the context"),
    ('{"messages": "hello"}', "non-empty list"),
    ('not json', "not a JSON object"),
    ('{"text": "no messages"}', "a conversation is an object"),
]


@pytest.mark.parametrize("line, words", BAD, ids=[w for _, w in BAD])
def test_a_bad_conversation_is_one_line_naming_file_and_line_and_nothing_is_written(tmp_path, capsys, line, words):
    good = json.dumps({"messages": CONVERSATIONS[0]}, ensure_ascii=False)
    write_jsonl(tmp_path / "c.jsonl", [])
    (tmp_path / "c.jsonl").write_text(f"{good}\n\n{good}\n{line}\n{good}\n", encoding="utf-8")
    before = tree(tmp_path)
    err = run_bad(capsys, "prepare", "--chat", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "d"),
                  "--context", "60")
    assert f"{tmp_path / 'c.jsonl'}:4" in err and words in err
    assert tree(tmp_path) == before


def test_a_character_the_source_s_char_vocabulary_lacks_is_refused_with_its_line(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("abc abc\n" * 50)
    run_ok(capsys, "prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "text"))
    write_jsonl(tmp_path / "c.jsonl", [[{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}],
                                       [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "bz"}]])
    err = run_bad(capsys, "prepare", "--chat", str(tmp_path / "c.jsonl"), "--tokenizer-from", str(tmp_path / "text"),
                  "--out", str(tmp_path / "d"))
    assert f"c.jsonl:2: message 2" in err and "'z'" in err and not (tmp_path / "d").exists()


# ---- rows and the loss -------------------------------------------------------------------------------------------

def test_rows_start_at_a_conversation_and_train_only_the_whole_ones_in_them():
    tokens = np.arange(100, 130)
    mask = np.array([i % 3 != 0 for i in range(30)], dtype=np.uint8)
    starts = np.array([0, 7, 9, 20, 26, 30])
    x, y = get_chat_batch(tokens, mask, starts, 64, 12, batch_generator(3, 0))
    assert x.shape == y.shape == (64, 12)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        s = row_x[0] - 100
        assert s in starts[:-1]
        # by hand: the pieces wholly inside [s, s + 13), and past the split's end nothing
        end = max(b for b in starts if b <= s + 13)
        for j in range(12):
            t = s + j + 1
            if t < 30:
                assert row_x[j] == 100 + s + j
            assert row_y[j] == (100 + t if t < end and mask[t] else -1), (s, j)
    assert {r[0] - 100 for r in x.tolist()} == set(starts[:-1].tolist())  # 64 draws reach every start


@pytest.fixture
def chat_data(tmp_path):
    convs = [[{"role": "user", "content": f"q{i}{'x' * (i % 5)}"}, {"role": "assistant", "content": "a" * (1 + i % 7)}]
             for i in range(40)]  # each its own: a row's first ids tell which conversation it starts at
    write_jsonl(tmp_path / "c.jsonl", convs)
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", PrepareConfig(chat=True, context=24, tokenizer="char"),
            quiet=True)
    return load_dataset(tmp_path / "d")


def trained_model(vocab):
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=vocab, block_size=24, n_layer=1, n_head=2, n_embd=16, dropout=0.0))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # away from the initial values
    return model


def assistant_positions(ids, tok):
    """Targets inside the assistant's turns, found from the markers alone: from after <|assistant|> to its <|end|>."""
    inside, out = False, []
    for i, t in enumerate(ids):
        out.append(inside)
        if t == tok.role_ids["assistant"]:
            inside = True
        elif t == tok.end_id:
            inside = False
    return out


def test_the_loss_is_the_assistant_s_alone_and_ignores_the_user_s_targets(chat_data):
    tok, ctx = chat_data.tokenizer, StepContext(chat_data, TrainConfig(batch_size=6), 24, torch.device("cpu"), "fp32")
    model = trained_model(tok.vocab_size)
    x, y = ctx.batch("train", batch_generator(0, 1))
    loss = ctx.loss(model, x, y)
    tokens, (mask, starts) = np.asarray(chat_data.train), chat_data.chat["train"]
    nll, keep = [], []
    for row in x.tolist():
        s = next(a for a in starts[:-1] if tokens[a:a + 24].tolist() == row[:len(tokens[a:a + 24])])  # unique
        window = np.concatenate([tokens[s:s + 25], np.zeros(max(0, s + 25 - len(tokens)), dtype=tokens.dtype)])
        whole_end = max(b for b in starts if b <= s + 25)
        full = torch.tensor(window[1:].astype(np.int64))
        logits = model(torch.from_numpy(window[None, :-1].astype(np.int64)))[0][0]
        scrambled = torch.where(torch.tensor(assistant_positions(window.tolist(), tok)[1:]), full,
                                torch.randint(tok.vocab_size, (24,)))  # the user's targets changed at random
        nll.append(F.cross_entropy(logits, scrambled.clamp(min=0), reduction="none"))
        keep.append(torch.tensor(assistant_positions(window.tolist(), tok)[1:]) &
                    (torch.arange(24) + s + 1 < whole_end))
    nll, keep = torch.stack(nll), torch.stack(keep)
    assert keep.sum() > 0 and (y != -1).sum() == keep.sum()
    assert loss.item() == pytest.approx((nll * keep).sum().item() / keep.sum().item(), rel=1e-5)


def test_a_step_s_loss_is_the_mean_over_its_lessons_across_micro_batches(chat_data):
    cfg = TrainConfig(batch_size=3, grad_accum=2, grad_clip=0.0, warmup_steps=0, lr=1.0, min_lr=1.0, seed=5)
    ctx = StepContext(chat_data, cfg, 24, torch.device("cpu"), "fp32")
    model = trained_model(chat_data.tokenizer.vocab_size)
    batches = [ctx.batch("train", batch_generator(cfg.seed, 0, micro)) for micro in range(2)]
    assert (batches[0][1] != -1).sum() != (batches[1][1] != -1).sum()  # unequal lessons: a plain mean would differ
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    reference = F.cross_entropy(model(x)[0].flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum") / (
        y != -1).sum()
    reference.backward()
    want = {n: p.detach() - p.grad for n, p in model.named_parameters()}  # SGD with lr 1
    model.zero_grad()
    loss, _ = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), ctx, 0)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_an_evaluation_of_few_conversations_scores_each_one_s_lessons_once(chat_data):
    """The val split's 4 conversations take 4 rows, fewer than eval_batches x batch_size: one pass, a row from each
    conversation's start with its own lessons alone, the loss their mean per lesson."""
    from gptlab.training.step import estimate_loss

    model = trained_model(chat_data.tokenizer.vocab_size)
    seen = []
    ctx = StepContext(chat_data, TrainConfig(batch_size=3, eval_batches=20), 24, torch.device("cpu"), "fp32")
    original = ctx.loss

    def loss(m, x, y):
        seen.append(y)
        return original(m, x, y)
    object.__setattr__(ctx, "loss", loss)
    val = estimate_loss(model, ctx)["val"]
    tokens, (mask, starts) = np.asarray(chat_data.val).astype(np.int64), chat_data.chat["val"]
    pieces = list(zip(starts[:-1].tolist(), starts[1:].tolist()))
    lessons = [np.where(mask[a + 1:b] == 1, tokens[a + 1:b], -1) for a, b in pieces]  # each piece's own targets
    targets = torch.cat([y.flatten() for y in seen[-2:]])  # after train's 36 in 12 batches: 4 rows in 2 of 3
    assert len(pieces) == 4 and len(seen) == 12 + 2
    assert sorted(targets[targets != -1].tolist()) == sorted(t for row in lessons for t in row.tolist() if t != -1)
    nats = [F.cross_entropy(model(torch.from_numpy(tokens[a:b - 1][None]))[0][0], torch.from_numpy(row),
                            ignore_index=-1, reduction="sum") for (a, b), row in zip(pieces, lessons)]
    assert val == pytest.approx(sum(nats).item() / sum(int((row != -1).sum()) for row in lessons), rel=1e-5)


# ---- fine-tuning a run on conversations --------------------------------------------------------------------------

def test_fine_tuning_grows_the_vocabulary_by_the_markers_at_the_mean_row(tmp_path, capsys):
    from gptlab.checkpoint import load_run, model_tensors
    from gptlab.hf.gpt2_folders import init_tensors

    (tmp_path / "corpus.txt").write_text(CORPUS)
    run_ok(capsys, "prepare", str(tmp_path / "corpus.txt"), "--out", str(tmp_path / "text"))
    run_ok(capsys, "train", "--data", str(tmp_path / "text"), "--run", str(tmp_path / "base"), "--max-steps", "3",
           "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "32", "--batch-size", "4",
           "--precision", "fp32", "--quiet")
    convs = [[{"role": "user", "content": "Speak"}, {"role": "assistant", "content": "First Citizen"}]] * 6
    write_jsonl(tmp_path / "c.jsonl", convs)
    run_ok(capsys, "prepare", "--chat", str(tmp_path / "c.jsonl"), "--tokenizer-from", str(tmp_path / "base"),
           "--out", str(tmp_path / "chat"), "--context", "32")
    base = model_tensors(load_run(tmp_path / "base").model)["transformer.wte.weight"]
    chat = load_dataset(tmp_path / "chat").tokenizer
    grown = init_tensors(tmp_path / "base", ModelConfig(**{**vars(load_run(tmp_path / "base").model_cfg),
                                                            "vocab_size": base.shape[0] + 4}), chat)
    wte = grown["transformer.wte.weight"]
    assert wte.shape == (base.shape[0] + 4, 16) and torch.equal(wte[:base.shape[0]], base)
    torch.testing.assert_close(wte[base.shape[0]:], base.mean(0).expand(4, 16))
    run_ok(capsys, "train", "--data", str(tmp_path / "chat"), "--init-from", str(tmp_path / "base"), "--run",
           str(tmp_path / "tuned"), "--max-steps", "2", "--batch-size", "4", "--precision", "fp32", "--quiet")
    tuned = load_run(tmp_path / "tuned")
    assert tuned.model_cfg.vocab_size == base.shape[0] + 4 and isinstance(tuned.tokenizer, ChatTokenizer)
    longest = len(chat.render(convs[0])[0])  # a row of block_size + 1 ids holds it whole at block_size longest - 1
    assert load_dataset(tmp_path / "chat").meta["chat"]["longest"] == longest
    run_ok(capsys, "train", "--data", str(tmp_path / "chat"), "--init-from", str(tmp_path / "base"), "--run",
           str(tmp_path / "fits"), "--block-size", str(longest - 1), "--max-steps", "1", "--quiet")
    err = run_bad(capsys, "train", "--data", str(tmp_path / "chat"), "--init-from", str(tmp_path / "base"), "--run",
                  str(tmp_path / "short"), "--block-size", str(longest - 2), "--max-steps", "1", "--quiet")
    assert f"conversations of up to {longest}" in err and f"--context {longest - 2}" in err


def test_validation_conversations_can_be_named_by_file_and_one_alone_is_not_enough(tmp_path, capsys):
    write_jsonl(tmp_path / "train.jsonl", CONVERSATIONS * 3)
    write_jsonl(tmp_path / "val.jsonl", CONVERSATIONS[1:2])
    run_ok(capsys, "prepare", "--chat", str(tmp_path / "train.jsonl"), "--val", str(tmp_path / "val.jsonl"),
           "--out", str(tmp_path / "d"))
    ds = load_dataset(tmp_path / "d")
    assert ds.meta["chat"]["conversations"] == {"train": 9, "val": 1} and ds.meta["split"] == "validation files"
    assert (np.asarray(ds.val).tolist(), np.asarray(ds.chat["val"][0]).tolist()) == by_hand(
        every_text(CONVERSATIONS), CONVERSATIONS[1])
    write_jsonl(tmp_path / "one.jsonl", CONVERSATIONS[:1])
    err = run_bad(capsys, "prepare", "--chat", str(tmp_path / "one.jsonl"), "--out", str(tmp_path / "e"))
    assert "one.jsonl holds 1 conversation(s); training and validation need at least 2" in err
    (tmp_path / "empty.jsonl").write_text("\n")
    err = run_bad(capsys, "prepare", "--chat", str(tmp_path / "train.jsonl"), "--val", str(tmp_path / "empty.jsonl"),
                  "--out", str(tmp_path / "e"))
    assert "holds 0 conversation(s); give at least 1" in err and not (tmp_path / "e").exists()


def test_conversations_starting_with_a_utf8_byte_order_mark_read_as_without_it(tmp_path):
    write_jsonl(tmp_path / "plain.jsonl", CONVERSATIONS)
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "plain.jsonl").read_bytes())
    cfg = PrepareConfig(chat=True, tokenizer="gpt2")
    built = {name: prepare([str(tmp_path / f"{name}.jsonl")], tmp_path / name, cfg, quiet=True)
             for name in ("plain", "bom")}
    assert built["bom"]["fingerprint"] == built["plain"]["fingerprint"]  # the same conversations, the same ids


def test_an_assistant_turn_of_exactly_the_context_is_taken(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [[{"role": "assistant", "content": "y" * 14}]] * 2)  # 1 + 14 + 1 ids
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", PrepareConfig(chat=True, context=16), quiet=True)
    assert load_dataset(tmp_path / "d").meta["chat"]["longest"] == 16


def test_the_same_conversations_again_change_nothing_and_others_are_refused(tmp_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    argv = ["prepare", "--chat", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "d")]
    run_ok(capsys, *argv)
    before, written = tree(tmp_path / "d"), (tmp_path / "d" / "meta.json").stat().st_mtime_ns
    run_ok(capsys, *argv)
    assert tree(tmp_path / "d") == before and (tmp_path / "d" / "meta.json").stat().st_mtime_ns == written
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 3)
    assert "prepared from other inputs or settings" in run_bad(capsys, *argv)
    assert tree(tmp_path / "d") == before
    run_ok(capsys, *argv, "--overwrite")
    assert load_dataset(tmp_path / "d").meta["chat"]["conversations"]["train"] == 8


def test_conversation_files_that_do_not_match_the_tokens_are_refused(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", PrepareConfig(chat=True), quiet=True)
    mask = np.load(tmp_path / "d" / "train.mask.npy")
    np.save(tmp_path / "d" / "train.mask.npy", mask[:-1])
    with pytest.raises(GptlabError, match="do not match its token files"):
        load_dataset(tmp_path / "d")
    np.save(tmp_path / "d" / "train.mask.npy", mask)
    starts = np.load(tmp_path / "d" / "train.starts.npy")
    np.save(tmp_path / "d" / "train.starts.npy", starts[:-1])
    with pytest.raises(GptlabError, match="do not match its token files"):
        load_dataset(tmp_path / "d")


def test_a_whole_conversation_renders_each_message_s_mask_and_the_prompt_is_not_trained(tokenizers):
    chars = every_text(CONVERSATIONS)
    tok = tokenizers["char"]
    for messages in CONVERSATIONS:
        ids, mask = by_hand(chars, messages)
        assert tok.render(messages) == (ids, [bool(m) for m in mask])
        assert tok.render(messages, add_generation_prompt=True) == (ids + [tok.role_ids["assistant"]],
                                                                    [bool(m) for m in mask] + [False])


def test_markers_in_text_are_special_tokens_only_when_allowed_and_bad_bytes_decode_replaced(tokenizers):
    tok = tokenizers["gpt2"]
    assert tok.encode("<|user|>hi<|end|>", allow_special=True) == [tok.role_ids["user"], *tok.encode("hi"),
                                                                   tok.end_id]
    bad = [i for i in range(256) if tok.decode_bytes([i]) == b"\xff"]
    assert tok.decode(bad + [tok.end_id]) == "\ufffd<|end|>"


# ---- issue 42, behaviour 6: another --chat-loss into the same folder, consecutive assistant turns, the context's
# edges, damaged conversation files ---------------------------------------------------------------------------------

def chat_pieces(messages, context, chars="sabcd"):
    """conversations.pieces of `messages` over CharTokenizer(chars) with the markers, as (ids, mask) lists."""
    from gptlab.data.conversations import Conversation, pieces

    return [(ids, [int(t) for t in trained]) for ids, trained in
            pieces(Conversation("c.jsonl:1", messages), ChatTokenizer(CharTokenizer(chars)), context)]


def saved_pieces(folder):
    """Every piece of both splits of a prepared folder, as (ids, mask) lists, sorted."""
    ds = load_dataset(folder)
    out = []
    for split in ("train", "val"):
        tokens, (mask, starts) = np.asarray(ds.split(split)), ds.chat[split]
        out += [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(starts[:-1], starts[1:])]
    return sorted(out)


def test_another_chat_loss_into_the_same_folder_is_refused_and_with_overwrite_rewrites_the_mask(tmp_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    argv = ["prepare", "--chat", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "d")]
    by_role = sorted(by_hand(every_text(CONVERSATIONS), m) for m in CONVERSATIONS * 2)  # the assistant's tokens
    every = sorted((ids, [1] * len(ids)) for ids, _ in by_role)
    run_ok(capsys, *argv, "--chat-loss", "assistant")
    assert saved_pieces(tmp_path / "d") == by_role
    before = tree(tmp_path / "d")
    err = run_bad(capsys, *argv, "--chat-loss", "all")  # not the old mask kept silently: refused, nothing changed
    assert f"{tmp_path / 'd'} holds data prepared from other inputs or settings" in err and "--overwrite" in err
    assert tree(tmp_path / "d") == before
    run_ok(capsys, *argv, "--chat-loss", "all", "--overwrite")
    assert saved_pieces(tmp_path / "d") == every and load_dataset(tmp_path / "d").meta["chat"]["loss"] == "all"
    after = tree(tmp_path / "d")
    run_ok(capsys, *argv, "--chat-loss", "all")  # the same settings again: the folder as it is
    assert tree(tmp_path / "d") == after
    run_ok(capsys, *argv, "--chat-loss", "assistant", "--overwrite")
    assert saved_pieces(tmp_path / "d") == by_role


def test_consecutive_assistant_messages_stay_with_their_user_turn_when_a_conversation_is_split():
    u1, a1, u2, a2, a3, a4 = ({"role": r, "content": c} for r, c in (
        ("user", "ab"), ("assistant", "ba"), ("user", "c"), ("assistant", "cc"), ("assistant", "a"),
        ("assistant", "b")))
    messages = [u1, a1, u2, a2, a3, a4]
    # by hand: a message is its marker, its characters and the end marker: 4 + 4 + 3 + 4 + 3 + 3 = 21 ids; the
    # exchanges are [u1 a1] (8) and [u2 a2 a3 a4] (13): the three answers in a row go together, never a piece that
    # starts with an assistant message with no user turn before it
    chars = "sabcd"
    assert chat_pieces(messages, 21) == chat_pieces(messages, 22) == [by_hand(chars, messages)]
    for context in (20, 13):
        assert chat_pieces(messages, context) == [by_hand(chars, [u1, a1]), by_hand(chars, [u2, a2, a3, a4])]
    with pytest.raises(GptlabError, match=r"^c.jsonl:1: the exchange from message 3 to 6 is longer than the "
                                          r"context \(12\); raise --context or shorten it$"):
        chat_pieces(messages, 12)


# by hand: system "s" 3 ids; exchanges [u1 "ab" 4, a1 "b" 3, a2 "ba" 4] 11, [u2 "c" 3, a3 "cc" 4] 7, [u3 "a" 3,
# a4 "b" 3] 6: 27 ids in all. Each piece is the system message and the whole exchanges that fit after it.
S, U1, A1, A2, U2, A3, U3, A4 = ({"role": r, "content": c} for r, c in (
    ("system", "s"), ("user", "ab"), ("assistant", "b"), ("assistant", "ba"), ("user", "c"), ("assistant", "cc"),
    ("user", "a"), ("assistant", "b")))
EDGES = [(28, [[S, U1, A1, A2, U2, A3, U3, A4]]),  # one past the conversation's 27
         (27, [[S, U1, A1, A2, U2, A3, U3, A4]]),  # at it: one piece
         (26, [[S, U1, A1, A2, U2, A3], [S, U3, A4]]),  # one below: split; the first piece 21
         (21, [[S, U1, A1, A2, U2, A3], [S, U3, A4]]),  # the first piece at the context
         (20, [[S, U1, A1, A2], [S, U2, A3, U3, A4]]),  # one below it: the second piece 16
         (16, [[S, U1, A1, A2], [S, U2, A3, U3, A4]]),  # the second piece at the context
         (15, [[S, U1, A1, A2], [S, U2, A3], [S, U3, A4]]),  # one below it
         (14, [[S, U1, A1, A2], [S, U2, A3], [S, U3, A4]])]  # the longest exchange with the system message: 14


@pytest.mark.parametrize("context, expected", EDGES, ids=[str(c) for c, _ in EDGES])
def test_a_conversation_just_below_at_and_past_the_context_is_split_at_whole_exchanges(context, expected):
    messages = [S, U1, A1, A2, U2, A3, U3, A4]
    assert chat_pieces(messages, context) == [by_hand("sabcd", piece) for piece in expected]


def test_an_exchange_or_an_assistant_turn_one_past_the_context_is_refused_naming_it():
    with pytest.raises(GptlabError, match=r"^c.jsonl:1: the exchange from message 2 to 4 with the system messages is "
                                          r"longer than the context \(13\)"):
        chat_pieces([S, U1, A1, A2, U2, A3, U3, A4], 13)
    answer = {"role": "assistant", "content": "abcd"}  # 6 ids
    assert chat_pieces([answer], 6) == [by_hand("sabcd", [answer])]
    with pytest.raises(GptlabError, match=r"^c.jsonl:1: message 2, an assistant turn of 6 tokens, is longer than "
                                          r"the context \(5\)"):
        chat_pieces([U2, answer], 5)


def test_a_conversation_of_context_plus_one_tokens_is_saved_split_and_one_of_the_context_whole(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", [[S, U1, A1, A2, U2, A3, U3, A4], [U3, A4]])
    for context, expected in ((27, [[S, U1, A1, A2, U2, A3, U3, A4]]), (26, [[S, U1, A1, A2, U2, A3], [S, U3, A4]])):
        cfg = PrepareConfig(chat=True, context=context, val_fraction=0.5, tokenizer="char")
        prepare([str(tmp_path / "c.jsonl")], tmp_path / str(context), cfg, quiet=True)
        chars = every_text([[S, U1, A1, A2, U2, A3, U3, A4]])
        assert saved_pieces(tmp_path / str(context)) == sorted([by_hand(chars, p) for p in expected] +
                                                               [by_hand(chars, [U3, A4])])


def test_consecutive_assistant_messages_are_dropped_together_to_fit_the_context():
    tok = ChatTokenizer(CharTokenizer("abcdefgh"))
    system, user, first, second, last = ({"role": r, "content": c} for r, c in (
        ("system", "ab"), ("user", "abc"), ("assistant", "a"), ("assistant", "bc"), ("user", "d")))
    # by hand: 4 + 5 + 3 + 4 + 3 ids and the prompt's 1: 20; one fewer drops the user turn and both answers
    assert fit_context([system, user, first, second, last], tok, 20) == ([system, user, first, second, last], 0)
    assert fit_context([system, user, first, second, last], tok, 19) == ([system, last], 3)
    # answers with no question before them: 4 + 3 + 4 + 3 + 1 = 15
    assert fit_context([system, first, second, last], tok, 15) == ([system, first, second, last], 0)
    assert fit_context([system, first, second, last], tok, 14) == ([system, last], 2)


DAMAGED = {"an empty piece": lambda s: np.insert(s, 2, s[2]), "an empty first piece": lambda s: np.insert(s, 0, 0),
           "an empty last piece": lambda s: np.append(s, s[-1]), "pieces out of order": lambda s: s[[0, 2, 1, 3, 4, 5]],
           "out of order, unsigned": lambda s: s[[0, 2, 1, 3, 4, 5]].astype(np.uint64),
           "not from 0": lambda s: np.r_[1, s[1:]], "from below 0": lambda s: np.r_[-1, s[1:]],
           "short of the length": lambda s: np.r_[s[:-1], s[-1] - 1],
           "past the length": lambda s: np.r_[s[:-1], s[-1] + 1],
           "no piece": lambda s: s[:1], "nothing": lambda s: s[:0], "not integers": lambda s: s.astype(np.float64),
           "two rows": lambda s: np.stack([s, s]), "one number": lambda s: np.asarray(s[-1])}


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_saved_split_with_an_empty_piece_or_starts_off_its_ends_is_refused_in_one_line(tmp_path, damage):
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", PrepareConfig(chat=True), quiet=True)
    starts = np.load(tmp_path / "d" / "train.starts.npy")
    assert len(starts) == 6 and np.all(np.diff(starts) > 1)  # five pieces of several ids: every damage applies
    np.save(tmp_path / "d" / "train.starts.npy", DAMAGED[damage](starts))
    with pytest.raises(GptlabError) as info:
        load_dataset(tmp_path / "d")
    assert str(info.value) == f"the train conversation files in {tmp_path / 'd'} do not match its token files; run " \
                              "`gptlab prepare --chat` again"


def test_a_saved_mask_of_two_columns_is_refused_in_one_line(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", PrepareConfig(chat=True), quiet=True)
    mask = np.load(tmp_path / "d" / "train.mask.npy")
    np.save(tmp_path / "d" / "train.mask.npy", np.stack([mask, mask], axis=1))  # as many rows as tokens
    with pytest.raises(GptlabError, match=r"^the train conversation files in .* do not match its token files"):
        load_dataset(tmp_path / "d")


def test_a_damaged_split_is_refused_by_the_command_in_one_line_naming_its_split(tmp_path, capsys):
    write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS * 2)
    prepare([str(tmp_path / "c.jsonl")], tmp_path / "d", PrepareConfig(chat=True), quiet=True)
    starts = np.load(tmp_path / "d" / "val.starts.npy")
    np.save(tmp_path / "d" / "val.starts.npy", np.insert(starts, 1, 0))  # an empty first piece
    err = run_bad(capsys, "train", "--data", str(tmp_path / "d"), "--run", str(tmp_path / "run"), "--max-steps", "1")
    assert "the val conversation files in" in err and "do not match its token files" in err
    assert not (tmp_path / "run").exists()
