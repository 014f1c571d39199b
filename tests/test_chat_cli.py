"""`gptlab chat`: a conversation in the terminal, held to outside references. What the model is asked each turn is
the ids transformers' apply_chat_template gives for the conversation (the run's tokenizer exported for Hugging
Face), and each greedy answer is the plain model's forward with the reference sampler (helpers.
reference_continuation) on those ids, cut at the end of turn; a sampled answer is what `gptlab sample` draws for the
same prompt and seed. Piped stdin gives the transcript; a real terminal (tmux) the prompt, Ctrl-C and /reset."""

import io
import os
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    SHELL,
    TINY,
    TMUX,
    Pane,
    chat_run,
    last_line,
    prompts,
    reference_continuation,
    run_bad,
    run_ok,
    tiny_run,
)

import gptlab
from gptlab import textstream
from gptlab.cli import main
from gptlab.config import SampleConfig, TrainConfig, to_dict

MAX_NEW = 12  # the answers' --max-new-tokens: the model's context of 64 leaves prompts 52 tokens
GREEDY = ["--temperature", "0", "--max-new-tokens", str(MAX_NEW)]
MARKERS = ("<|end|>", "<|system|>", "<|user|>", "<|assistant|>")  # an answer ends at the first of these


def talking_run(root):
    """chat_run's model moved off its init (seeded noise of 0.3 on every weight, end-of-turn logit raised by 1):
    its greedy answers are a few characters that depend on the whole conversation and end by themselves."""
    from gptlab.checkpoint import load_run, save_checkpoint
    from gptlab.rundir import TrainingState

    run = chat_run(root, end_logit=1.0)
    model = load_run(run).model
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=noise))
    state = TrainingState(model=to_dict(model.config), train=to_dict(TrainConfig(max_steps=2)), best_val_loss=0.5,
                          val_loss=0.5)
    save_checkpoint(run, "best", 2, model, state, extra_files={"tokenizer.json": (run / "tokenizer.json").read_bytes()})
    assert load_run(run).checkpoint.step == 2
    return run


@pytest.fixture(scope="module")
def talking(tmp_path_factory):
    """The run, its plain fp32 model, and its tokenizer as transformers loads the export (offline)."""
    from transformers import AutoTokenizer

    from gptlab.checkpoint import load_run
    from gptlab.hf.hf_tokenizer import write_tokenizer_files

    root = tmp_path_factory.mktemp("chat")
    run = talking_run(root)
    loaded = load_run(run)
    (root / "hf").mkdir()
    write_tokenizer_files(root / "hf", loaded.tokenizer, 64)
    hf = AutoTokenizer.from_pretrained(root / "hf")
    ends = set(hf.convert_tokens_to_ids(list(MARKERS)))

    def template(messages, tokenize=True):
        return list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=tokenize, return_dict=False))

    def answer(messages):
        generated = reference_continuation(loaded.model, template(messages), SampleConfig(temperature=0,
                                                                                           max_new_tokens=MAX_NEW))
        cut = next((i for i, t in enumerate(generated) if t in ends), len(generated))
        return hf.decode(generated[:cut])

    text = lambda messages: hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)  # noqa: E731
    return SimpleNamespace(run=run, template=template, answer=answer, text=text)


def chat(monkeypatch, capsys, run, stdin, *flags, interrupt_after=None):
    """`gptlab chat` in this process with `stdin` as its input (a pipe, not a terminal): (exit code, stdout,
    stderr, the prompt ids of each answer). With interrupt_after=n, Ctrl-C arrives after the first answer's n-th
    token."""
    seen, real = [], textstream.generate_batch

    def spy(model, prompts, cfg, *rest, **kwargs):
        seen.append(list(prompts[0]))
        ids = real(model, prompts, cfg, *rest, **kwargs)
        return ids if interrupt_after is None or len(seen) > 1 else interrupted(ids, interrupt_after)

    monkeypatch.setattr(textstream, "generate_batch", spy)
    monkeypatch.setattr(sys, "stdin", stdin if isinstance(stdin, io.StringIO) else io.StringIO(stdin))
    code = main(["chat", "--run", str(run), "--device", "cpu", "--precision", "fp32", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err, seen


def interrupted(ids, n):
    for k, row in enumerate(ids):
        if k == n:
            raise KeyboardInterrupt
        yield row


def transcript(*turns):
    """What stdout shows for (line typed, answer or None for a command) pairs, then the end of input."""
    return "".join(f"you> {line}\n" + ("" if answer is None else f"assistant> {answer}\n")
                   for line, answer in turns) + "you> \n"


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def system(text):
    return {"role": "system", "content": text}


def test_two_turns_are_answered_with_the_history(talking, monkeypatch, capsys):
    first = [user("hello")]
    a1 = talking.answer(first)
    second = first + [assistant(a1), user("how are you?")]
    a2 = talking.answer(second)
    assert a1 and a2 != talking.answer(second[-1:])  # the test's premise: the history changes the second answer
    code, out, err, seen = chat(monkeypatch, capsys, talking.run, "hello\nhow are you?\n", *GREEDY)
    assert code == 0, err
    assert out == transcript(("hello", a1), ("how are you?", a2))
    assert seen == [talking.template(first), talking.template(second)]
    assert "Traceback" not in err


def test_reset_forgets_the_conversation_but_keeps_the_system_message(talking, monkeypatch, capsys):
    first = [system("be brief"), user("hello")]
    a1 = talking.answer(first)
    fresh = [system("be brief"), user("how are you?")]
    assert talking.answer(fresh) != talking.answer(first + [assistant(a1), user("how are you?")])  # premise
    code, out, err, seen = chat(monkeypatch, capsys, talking.run, "hello\n/reset\nhow are you?\n/quit\nnever\n",
                                "--system", "be brief", *GREEDY)
    assert code == 0, err
    assert out == transcript(("hello", a1), ("/reset", None), ("how are you?", talking.answer(fresh)),
                             ("/quit", None))[:-len("you> \n")]  # /quit ends: no prompt after it
    assert seen == [talking.template(first), talking.template(fresh)]
    assert "gptlab: the conversation is forgotten (the system message stays)" in err.splitlines()


@pytest.mark.parametrize("block_size, expected", [(64, 32), (7, 3), (3, 1)])
def test_answers_get_half_the_context_unless_told(block_size, expected):
    from gptlab.cli import make_parser
    from gptlab.cli.chat_verbs import chat_config

    args = make_parser().parse_args(["chat"])
    assert chat_config(args, block_size).max_new_tokens == expected  # by hand: block_size // 2
    told = make_parser().parse_args(["chat", "--max-new-tokens", str(block_size - 1)])
    assert chat_config(told, block_size).max_new_tokens == block_size - 1  # the most that leaves room


def test_chat_help_says_what_it_does_and_what_run_it_picks(capsys):
    from gptlab.cli.chat_verbs import DESCRIPTION

    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert " ".join(DESCRIPTION.split())[:60] in shown
    assert "--run RUN run folder (default: the most recent under runs/)" in shown
    assert "--system TEXT start with this system message (change it with /system TEXT)" in shown
    assert "sampling settings (each answer is a sample; see the seeds above):" in shown


def test_a_typed_line_is_kept_as_typed_but_for_its_line_ending(talking, monkeypatch, capsys):
    lines = ["hello  ", "say X"]  # trailing spaces and a last letter X are the user's; "\r\n" is not
    first = [user(lines[0])]
    second = first + [assistant(talking.answer(first)), user(lines[1])]
    code, out, err, seen = chat(monkeypatch, capsys, talking.run, "hello  \r\nsay X\n", *GREEDY)
    assert code == 0, err
    assert seen == [talking.template(first), talking.template(second)]
    assert out.startswith("you> hello  \n")


@pytest.mark.parametrize("command", ["/exit", "/quit"])
def test_exit_and_quit_each_end_the_conversation_before_the_next_line(talking, monkeypatch, capsys, command):
    code, out, err, seen = chat(monkeypatch, capsys, talking.run, f"hello\n{command}\nnever\n", *GREEDY)
    assert code == 0, err
    assert out == transcript(("hello", talking.answer([user("hello")])), (command, None))[:-len("you> \n")]
    assert len(seen) == 1  # "never" is not answered


def test_system_sets_replaces_and_removes_the_system_message(talking, monkeypatch, capsys):
    one = [system("hi"), user("hello")]
    a1 = talking.answer(one)
    two = [system("be brief"), user("hello"), assistant(a1), user("ok")]
    a2 = talking.answer(two)
    three = two[1:] + [assistant(a2), user("so")]
    lines = "hello\n/system be brief\nok\n/system\nso\n"
    code, out, err, seen = chat(monkeypatch, capsys, talking.run, lines, "--system", "hi", *GREEDY)
    assert code == 0, err
    assert seen == [talking.template(one), talking.template(two), talking.template(three)]
    assert out == transcript(("hello", a1), ("/system be brief", None), ("ok", a2), ("/system", None),
                             ("so", talking.answer(three)))
    notices = [line for line in err.splitlines() if line.startswith("gptlab: system message")]
    assert notices == ["gptlab: system message set", "gptlab: system message removed"]


def test_a_full_context_drops_the_oldest_turns_and_says_how_many(talking, monkeypatch, capsys):
    lines = ["hello there", "how are you today?", "tell me more", "and then?", "why not"]
    history, prompts, answers, drops = [system("be brief")], [], [], []
    for line in lines:  # the reference: drop the oldest (question, answer) pair until prompt + answer fit 64
        history.append(user(line))
        dropped = 0
        while len(talking.template(history)) + MAX_NEW > 64:
            del history[1:3]
            dropped += 2
        if dropped:
            drops.append(dropped)
        prompts.append(talking.template(history))
        answers.append(talking.answer(history))
        history.append(assistant(answers[-1]))
    assert drops  # premise: the conversation outgrows the context
    code, out, err, seen = chat(monkeypatch, capsys, talking.run, "".join(f"{x}\n" for x in lines), "--system",
                                "be brief", *GREEDY)
    assert code == 0, err
    assert seen == prompts
    assert out == transcript(*zip(lines, answers))
    said = [int(n) for n in re.findall(r"dropped its (\d+) oldest message", err)]
    assert said == drops, err
    assert [line for line in err.splitlines() if "outgrew" in line] == [
        f"gptlab: the conversation outgrew the model's context: dropped its {n} oldest messages" for n in drops]
    assert "answer stopped" not in err  # every answer ran to its end


def test_ctrl_c_during_an_answer_keeps_what_it_said(talking, monkeypatch, capsys):
    first = [user("how are you?")]
    whole = talking.answer(first)
    assert len(whole) > 3  # premise: the answer is stopped before its end
    second = first + [assistant(whole[:3]), user("hello")]
    code, out, err, seen = chat(monkeypatch, capsys, talking.run, "how are you?\nhello\n", *GREEDY, interrupt_after=3)
    assert code == 0, err
    assert out == transcript(("how are you?", whole[:3]), ("hello", talking.answer(second)))
    assert seen[1] == talking.template(second)
    assert "gptlab: answer stopped; what it said stays in the conversation" in err.splitlines()
    assert "Traceback" not in err


class CtrlCAtTheEnd(io.StringIO):
    """Piped input whose reader gets Ctrl-C once the lines are read (where a terminal's user presses it)."""

    def readline(self, *args):
        line = super().readline(*args)
        if not line:
            raise KeyboardInterrupt
        return line


def test_ctrl_c_at_the_prompt_ends_with_130(talking, monkeypatch, capsys):
    code, out, err, _ = chat(monkeypatch, capsys, talking.run, CtrlCAtTheEnd("hello\n"), *GREEDY)
    assert code == 130
    assert out == transcript(("hello", talking.answer([user("hello")])))
    assert "Traceback" not in err


def test_answer_n_is_drawn_as_gptlab_sample_draws_with_seed_plus_n_minus_1(talking, monkeypatch, capsys):
    flags = ["--temperature", "1", "--max-new-tokens", str(MAX_NEW), "--seed", "7"]

    def sample(messages, seed):
        out = run_ok(capsys, "sample", "--run", str(talking.run), "--prompt", talking.text(messages),
                     "--allow-special", "--no-echo", "--device", "cpu", "--precision", "fp32", *flags, "--seed",
                     str(seed))
        return re.split(r"<\|(?:system|user|assistant)\|>", out.removesuffix("\n"))[0]  # chat ends at a marker

    first = [user("hello")]
    a1 = sample(first, 7)
    second = first + [assistant(a1), user("how are you?")]
    a2 = sample(second, 8)
    assert a2 != sample(second, 7)  # premise: the seed of answer 2 shows
    third = second + [assistant(a2), user("so?")]
    a3 = sample(third, 9)
    assert a3 != sample(third, 8)  # premise: the seed of answer 3 shows
    code, out, err, _ = chat(monkeypatch, capsys, talking.run, "hello\nhow are you?\nso?\n/reset\nhello\n", *flags)
    assert code == 0, err
    assert out == transcript(("hello", a1), ("how are you?", a2), ("so?", a3), ("/reset", None), ("hello", a1))
    assert "gptlab: the conversation is forgotten" in err.splitlines()  # no system message to keep: none said


def test_refusals_are_one_line(talking, monkeypatch, capsys, tmp_path):
    plain = tiny_run(tmp_path, 1, TINY)  # a run without a chat template
    line = run_bad(capsys, "chat", "--run", str(plain))
    assert "has no chat template" in line
    line = run_bad(capsys, "chat", "--run", str(talking.run), "--max-new-tokens", "64")
    assert "leaves no room" in line and line.endswith("context of 64 tokens; give at most 63")
    assert "temperature must be a number" in run_bad(capsys, "chat", "--run", str(talking.run), "--temperature", "hot")
    # a message the vocabulary cannot hold, or an unknown command: one line, and the conversation goes on
    code, out, err, seen = chat(monkeypatch, capsys, talking.run, "日本\n/nope\nhello\n", *GREEDY)
    assert code == 0
    assert out == transcript(("日本", None), ("/nope", None), ("hello", talking.answer([user("hello")])))
    assert seen == [talking.template([user("hello")])]
    errors = [x for x in err.splitlines() if x.startswith("gptlab: error:")]
    assert len(errors) == 2 and "never seen" in errors[0] and "/nope" in errors[1], err


# ---- a real terminal ---------------------------------------------------------------------------------------------

@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (`make browser` installs it: the Makefile's APT_TOOLS)")
def test_a_conversation_in_a_terminal(talking):
    a1 = talking.answer([user("hello")])
    a2 = talking.answer([user("hello"), assistant(a1), user("how are you?")])
    fresh = talking.answer([user("how are you?")])
    assert "\n" not in a1 + a2 + fresh and a2 != fresh  # premise: one line each, and /reset shows
    src = Path(gptlab.__file__).resolve().parents[1]
    pane = Pane()
    try:
        pane.wait(lambda s: last_line(s) == SHELL, "the shell's prompt")
        path = os.pathsep.join([str(src), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]).rstrip(os.pathsep)
        pane.run(f"env PYTHONPATH={shlex.quote(path)} {sys.executable} -m gptlab chat --run {talking.run} --device cpu "
                 f"--precision fp32 {' '.join(GREEDY)}")
        pane.wait(lambda s: prompts(s) == 1, "the first prompt")
        for n, line in enumerate(["hello", "how are you?", "/reset", "how are you?"], 2):
            pane.type(line)
            screen = pane.wait(lambda s, n=n: prompts(s) == n, f"prompt {n}")
        shown = [x.rstrip() for x in screen.splitlines() if x.startswith(("you>", "assistant>"))]
        assert shown == ["you> hello", f"assistant> {a1}".rstrip(), "you> how are you?",
                         f"assistant> {a2}".rstrip(), "you> /reset", "you> how are you?",
                         f"assistant> {fresh}".rstrip(), "you>"]
        assert "the conversation is forgotten" in screen
        pane.keys("C-c")  # at the prompt: gptlab chat ends, and the shell's prompt is back
        pane.wait(lambda s: last_line(s) == SHELL and prompts(s) == 5, "the shell's prompt after Ctrl-C")
        pane.type("echo exit=$?")
        screen = pane.wait(lambda s: re.search(r"^exit=\d+", s, re.M), "the exit code")
        assert re.search(r"^exit=(\d+)", screen, re.M).group(1) == "130"
        assert "Traceback" not in screen
    finally:
        pane.close()
