"""LoRA on conversations: the chat markers a fine-tune adds get whole trainable rows (PEFT's trainable tokens), the
base's rows stay frozen; merged equals unmerged; PEFT loads the exported adapters, markers included, onto
transformers' GPT-2 of the exported base grown to the adapter's tokenizer, with equal logits; the adapter imports
back as the same model; a merged export carries the markers and the template to transformers. The base is a tiny
random GPT-2 over GPT-2's vocabulary, imported."""

import json

import pytest
import torch
from helpers import hf_folder, run_ok

from gptlab.checkpoint import find_checkpoint, load_run, model_tensors, read_tensors
from gptlab.tokenizer import ChatTokenizer

CHATS = [[{"role": "system", "content": "Tu es bref."}, {"role": "user", "content": f"Combien font {a} et {b} ?"},
          {"role": "assistant", "content": f"{a + b}, évidemment."}] for a in range(6) for b in range(4)]
FLAGS = ["--block-size", "48", "--batch-size", "4", "--grad-accum", "1", "--lr", "5e-2", "--min-lr", "5e-2",
         "--warmup-steps", "0", "--eval-interval", "6", "--eval-batches", "1", "--precision", "fp32", "--device",
         "cpu", "--dropout", "0", "--quiet", "--lora-rank", "4", "--lora-alpha", "16", "--max-steps", "6"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """runs/base: a tiny random GPT-2 imported; chat: the conversations with GPT-2's tokenizer + markers; runs/chat:
    LoRA adapters and the markers' rows trained 6 steps on them at a high learning rate."""
    root = tmp_path_factory.mktemp("lora-chat")
    hf_folder(root / "hf", seed=3, vocab_size=50257, n_embd=32, n_head=2, n_layer=2, n_positions=64)
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n"
                                              for c in CHATS), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        from gptlab.cli import main

        assert main(["import", "hf", "hf", "--run", "runs/base"]) == 0
        assert main(["prepare", "--chat", "chats.jsonl", "--tokenizer-from", "runs/base", "--out", "chat",
                     "--context", "48", "--quiet"]) == 0
        assert main(["train", "--data", "chat", "--init-from", "runs/base", "--run", "runs/chat", *FLAGS]) == 0
    return root


def markers_in(ids_len, tokenizer):
    """Token ids holding every chat marker and ordinary GPT-2 ids."""
    torch.manual_seed(1)
    x = torch.randint(0, 50257, (2, ids_len))
    x[0, :4] = torch.tensor(sorted(tokenizer.special_ids.values()))
    x[1, -3:] = torch.tensor([tokenizer.end_id, tokenizer.role_ids["assistant"], tokenizer.end_id])
    return x


def test_the_markers_rows_train_whole_and_the_base_s_rows_stay(tuned):
    base = model_tensors(load_run(tuned / "runs" / "base").model)["transformer.wte.weight"]
    saved = read_tensors(find_checkpoint(tuned / "runs" / "chat", "step").path, "model")
    assert saved["transformer.wte.token_ids"].tolist() == [50257, 50258, 50259, 50260]
    assert saved["transformer.wte.token_values"].shape == (4, 32)
    merged = load_run(tuned / "runs" / "chat").model.transformer.wte.weight
    assert merged.shape == (50261, 32) and torch.equal(merged[:50257], base)
    start = base.double().mean(0).float()  # where fine-tuning put them: the mean row
    assert all((merged[i] - start).abs().max() > 1e-3 for i in range(50257, 50261))  # and training moved them


def test_merged_equals_unmerged_on_the_markers_too(tuned):
    plain = load_run(tuned / "runs" / "chat", merge=False)
    merged = load_run(tuned / "runs" / "chat").model
    x = markers_in(40, plain.tokenizer)
    torch.testing.assert_close(merged(x)[0], plain.model(x)[0], rtol=0, atol=1e-5)


def test_peft_loads_the_adapters_and_the_markers_onto_the_grown_base_with_equal_logits(tuned, capsys):
    from peft import PeftModel
    from transformers import AutoTokenizer, GPT2LMHeadModel

    run_ok(capsys, "export", str(tuned / "runs" / "base"), "--format", "hf", "--out", str(tuned / "base-hf"))
    out = run_ok(capsys, "export", str(tuned / "runs" / "chat"), "--format", "peft", "--out", str(tuned / "peft"))
    assert "resize_token_embeddings" in out
    config = json.loads((tuned / "peft" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == [50257, 50258, 50259, 50260]
    tokenizer = AutoTokenizer.from_pretrained(tuned / "peft")
    model = GPT2LMHeadModel.from_pretrained(tuned / "base-hf")
    model.resize_token_embeddings(len(tokenizer))
    peft = PeftModel.from_pretrained(model, tuned / "peft").eval()
    ours = load_run(tuned / "runs" / "chat", merge=False)
    x = markers_in(40, ours.tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(peft(input_ids=x).logits, ours.model(x)[0], rtol=0, atol=1e-5)
    ids = tokenizer.apply_chat_template(CHATS[0][:2], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == ours.tokenizer.render(CHATS[0][:2], add_generation_prompt=True)[0]

    run_ok(capsys, "import", "peft", str(tuned / "peft"), "--base", str(tuned / "runs" / "base"), "--run",
           str(tuned / "runs" / "back"))
    back = load_run(tuned / "runs" / "back")
    assert isinstance(back.tokenizer, ChatTokenizer) and back.model_cfg.vocab_size == 50261
    torch.testing.assert_close(back.model(x)[0], ours.model(x)[0], rtol=0, atol=1e-5)


def test_a_merged_export_carries_the_markers_and_the_template_to_transformers(tuned, capsys):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    run_ok(capsys, "export", str(tuned / "runs" / "chat"), "--merge", "--out", str(tuned / "merged"))
    model = GPT2LMHeadModel.from_pretrained(tuned / "merged").eval()
    tokenizer = AutoTokenizer.from_pretrained(tuned / "merged")
    ours = load_run(tuned / "runs" / "chat")
    assert model.config.vocab_size == 50261 and len(tokenizer) == 50261
    x = markers_in(40, ours.tokenizer)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, ours.model(x)[0], rtol=0, atol=1e-5)
    ids = tokenizer.apply_chat_template(CHATS[3], tokenize=True)
    assert list(ids["input_ids"] if hasattr(ids, "keys") else ids) == ours.tokenizer.render(CHATS[3])[0]


def test_a_peft_folder_with_bad_token_indices_or_a_damaged_config_is_one_line(tuned, capsys, tmp_path):
    import shutil

    from helpers import run_bad

    if not (tuned / "peft").exists():
        run_ok(capsys, "export", str(tuned / "runs" / "chat"), "--format", "peft", "--out", str(tuned / "peft"))
    config = json.loads((tuned / "peft" / "adapter_config.json").read_text())
    for n, (indices, words) in enumerate(((["a", "b"], "not a list of token ids"), ({"lm_head": [1]}, "not a list"),
                                          ({"transformer.wte": [50257, 50258, 50259, 50260]}, None))):
        folder = tmp_path / f"p{n}"
        shutil.copytree(tuned / "peft", folder)
        (folder / "adapter_config.json").write_text(json.dumps({**config, "trainable_token_indices": indices}))
        argv = ["import", "peft", str(folder), "--base", str(tuned / "runs" / "base"), "--run", str(tmp_path / f"r{n}")]
        if words:
            assert words in run_bad(capsys, *argv)
        else:  # one embedding's ids by module name, as PEFT also writes them
            run_ok(capsys, *argv)
    (folder / "adapter_config.json").write_text(json.dumps({**config, "trainable_token_indices": [1, 2, 3, 4]}))
    said = run_bad(capsys, "import", "peft", str(folder), "--base", str(tuned / "runs" / "base"), "--run",
                   str(tmp_path / "r7"))  # ids the base has, not the markers: the adapter is not gptlab's chat
    assert "trains the rows of tokens [1, 2, 3, 4], which are not the chat markers" in said
    assert "([50257, 50258, 50259, 50260])" in said
    (folder / "adapter_config.json").write_text(json.dumps(config))  # the markers, onto a base that has them
    said = run_bad(capsys, "import", "peft", str(folder), "--base", str(tuned / "runs" / "chat"), "--run",
                   str(tmp_path / "r8"))
    assert "which are not the chat markers added to the base's tokenizer" in said
    assert not (tmp_path / "r7").exists() and not (tmp_path / "r8").exists()
    (folder / "adapter_config.json").write_text("{")
    assert "is damaged (not valid JSON)" in run_bad(capsys, "import", "peft", str(folder), "--base",
                                                    str(tuned / "runs" / "base"), "--run", str(tmp_path / "r9"))


def test_a_peft_export_takes_the_best_checkpoint_not_the_latest(tuned, capsys, tmp_path, monkeypatch):
    import shutil

    from safetensors.torch import load_file

    from gptlab.hf.peft import PEFT_TOKENS, PREFIX, export_peft

    run = tmp_path / "chat"
    shutil.copytree(tuned / "runs" / "chat", run)
    monkeypatch.chdir(tmp_path)  # elsewhere than where it was started with --init-from runs/base: found all the same
    run_ok(capsys, "train", "--run", str(run), "--resume", "--max-steps", "9", "--eval-interval", "100",
           "--lr", "1.0", "--min-lr", "1.0", "--quiet")  # three more steps at a learning rate far too high
    best, latest = find_checkpoint(run, "best"), find_checkpoint(run, "step")
    assert (best.step, latest.step) == (6, 9)  # the last evaluation, at step 9, was worse
    names = export_peft(run, tmp_path / "peft")
    assert names[:2] == ["adapter_config.json", "adapter_model.safetensors"] and "tokenizer.json" in names
    said = json.loads((tmp_path / "peft" / "tokenizer_config.json").read_text())  # the markers' tokenizer, the context
    assert said["model_max_length"] == json.loads((run / "config.json").read_text())["model"]["block_size"]
    exported = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    torch.testing.assert_close(exported[PREFIX + PEFT_TOKENS], read_tensors(best.path, "model")[
        "transformer.wte.token_values"], rtol=0, atol=0)


def test_an_adapter_s_parameters_count_the_markers_rows_alike_in_import_and_info(tuned, capsys):
    import re

    run_ok(capsys, "export", str(tuned / "runs" / "chat"), "--format", "peft", "--out", str(tuned / "peft-count"))
    out = run_ok(capsys, "import", "peft", str(tuned / "peft-count"), "--base", str(tuned / "runs" / "base"), "--run",
                 str(tuned / "runs" / "counted"))
    adapters, rows = 2 * 4 * (32 + 96), 4 * 32  # rank 4 on c_attn (32 -> 96) in 2 blocks; 4 markers, 32 wide
    assert int(re.search(r"([\d,]+) adapter parameters", out).group(1).replace(",", "")) == adapters + rows
    for run in ("chat", "counted"):
        assert f"({adapters + rows:,} parameters)" in run_ok(capsys, "info", str(tuned / "runs" / run)), run
