"""`gptlab bench chat`: chat fine-tuning on a synthetic task, measured by held-out accuracy.

Conversations are generated from a seed: the user asks "reverse: WORD" (WORD of random letters) and the assistant
answers the word reversed; some conversations open with a system message. They are written as JSONL (the format
users give `gptlab prepare --chat`), the held-out questions never among the training ones. A small char GPT is
pretrained briefly on the bundled Tiny Shakespeare (it knows the letters, not the task, nor the chat markers), then
fine-tuned on the conversations twice from the same weights and for the same steps: with the loss on the
assistant's tokens only (chat_loss "assistant", the mask) and on every token (chat_loss "all"). Each model answers
the held-out questions greedily; an answer is right when its text up to the end marker, stripped, is the reversed
word. The base before fine-tuning has no chat markers: it is asked the same questions as plain text (the system
message and the question, each on its own line), its answer read up to the next line break."""

from __future__ import annotations

import json
import random
import string
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the clocks are imported by the run: the settings (`bench chat --help`) need neither
    import torch

    from gptlab.tokenizer import Tokenizer

SYSTEM = "Reverse the word."


@dataclass
class ChatBenchSettings:
    """Sizes of the bench: the task, the base's pretraining and the fine-tuning (defaults: the full bench)."""

    train: int = 5000  # training conversations
    held: int = 300  # held-out questions
    min_len: int = 3  # word lengths
    max_len: int = 6
    alphabet: str = string.ascii_lowercase
    system_share: float = 0.25  # conversations that open with the system message
    seed: int = 0
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 96
    block_size: int = 64
    batch_size: int = 32
    base_steps: int = 200
    base_lr: float = 6e-3
    steps: int = 1500  # fine-tuning steps of each variant
    lr: float = 6e-3
    precision: str = "fp32"  # faster than bf16 at this size on the CPUs measured


def question(word: str) -> str:
    return f"reverse: {word}"


def conversation(word: str, system: bool) -> dict[str, Any]:
    """One conversation: the optional system message, the question about `word`, the assistant's answer."""
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    messages += [{"role": "user", "content": question(word)}, {"role": "assistant", "content": word[::-1]}]
    return {"messages": messages}


def make_conversations(s: ChatBenchSettings) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training conversations, held-out ones) drawn from s.seed: words of s.min_len to s.max_len letters of
    s.alphabet, s.held distinct held-out words, none of them among the training ones (which may repeat); a share
    s.system_share open with the system message. GptlabError when the alphabet and lengths hold too few words."""
    from gptlab.errors import GptlabError

    possible = sum(len(set(s.alphabet)) ** n for n in range(s.min_len, s.max_len + 1))
    if possible <= s.held:
        raise GptlabError(f"{possible} words of {s.min_len} to {s.max_len} letters of {s.alphabet!r} are too few "
                          f"for {s.held} held-out questions and training on others; give more letters or lengths")
    rng = random.Random(s.seed)

    def word() -> str:
        return "".join(rng.choice(s.alphabet) for _ in range(rng.randint(s.min_len, s.max_len)))

    held_words: list[str] = []
    while len(held_words) < s.held:
        w = word()
        if w not in held_words:
            held_words.append(w)
    unseen = set(held_words)
    train = []
    while len(train) < s.train:
        w = word()
        if w not in unseen:
            train.append(conversation(w, rng.random() < s.system_share))
    held = [conversation(w, rng.random() < s.system_share) for w in held_words]
    return train, held


def write_jsonl(path: Path, conversations: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(c) + "\n" for c in conversations), encoding="utf-8")
    return path


def _train(run: Path, data: Path, s: ChatBenchSettings, steps: int, lr: float, init_from: str = "") -> float:
    """Train `run` on `data` for `steps` (from `init_from`'s weights when given); returns the seconds it took."""
    from gptlab.runs import resolve, start

    model = {} if init_from else dict(n_layer=s.n_layer, n_head=s.n_head, n_embd=s.n_embd, block_size=s.block_size,
                                      dropout=0.0)
    train = dict(batch_size=s.batch_size, max_steps=steps, lr=lr, min_lr=lr / 10, warmup_steps=min(50, steps // 10),
                 eval_interval=steps, eval_batches=2, log_interval=steps, seed=s.seed, precision=s.precision,
                 init_from=init_from, device="cpu")
    spec = resolve("char-quick", model=model, train=train, run=run, data=data, quiet=True)
    t = time.perf_counter()
    start(spec, quiet=True)
    return time.perf_counter() - t


def pretrain_base(folder: Path, s: ChatBenchSettings, corpus: list[str] | None = None) -> tuple[Path, float]:
    """A char GPT pretrained for s.base_steps on `corpus` (files; default the bundled Tiny Shakespeare) in
    `folder`/base: (the run, seconds of training)."""
    from gptlab.data.prepare import prepare

    prepare(corpus or [], folder / "base-data", "char", workers=1, quiet=True)
    return folder / "base", _train(folder / "base", folder / "base-data", s, s.base_steps, s.base_lr)


def finetune(folder: Path, base: Path, conversations: Path, loss: str, s: ChatBenchSettings) -> tuple[Path, float]:
    """The base fine-tuned on the conversations with chat_loss `loss` for s.steps, in `folder`/sft-LOSS."""
    from gptlab.config import PrepareConfig
    from gptlab.data.prepare import prepare

    data = folder / f"sft-data-{loss}"
    prepare([str(conversations)], data, PrepareConfig(chat=True, context=s.block_size, chat_loss=loss,
                                                      tokenizer_from=str(base), val_fraction=0.02, seed=s.seed),
            quiet=True)
    run = folder / f"sft-{loss}"
    return run, _train(run, data, s, s.steps, s.lr, init_from=str(base))


def chat_answers(run: Path, held: list[dict[str, Any]], max_new_tokens: int) -> list[str]:
    """The run's greedy answer to each held-out conversation's question, rendered with the chat template: its
    text up to the end marker, stripped."""
    from gptlab.checkpoint import load_run
    from gptlab.tokenizer import chat_of

    loaded = load_run(run)
    tok = chat_of(loaded.tokenizer)
    prompts = [tok.render(c["messages"][:-1], add_generation_prompt=True)[0] for c in held]
    return _greedy(loaded.model, tok, prompts, max_new_tokens, stop=[])


def plain_answers(run: Path, held: list[dict[str, Any]], max_new_tokens: int) -> list[str]:
    """The run's greedy answer to each held-out question asked as plain text (each message's content on its own
    line, no chat markers): its text up to the next line break, stripped."""
    from gptlab.checkpoint import load_run

    loaded = load_run(run)
    prompts = [loaded.tokenizer.encode("".join(m["content"] + "\n" for m in c["messages"][:-1])) for c in held]
    return _greedy(loaded.model, loaded.tokenizer, prompts, max_new_tokens, stop=["\n"])


def _greedy(model: torch.nn.Module, tok: Tokenizer, prompts: list[list[int]], max_new_tokens: int,
            stop: list[str]) -> list[str]:
    from gptlab.config import SampleConfig
    from gptlab.inference.loading import prepare_for_inference
    from gptlab.textstream import complete

    prepared = prepare_for_inference(model, "fp32")
    cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=0, stop=stop)
    return [c.text.strip() for c in complete(prepared, tok, prompts, cfg)]


def accuracy(answers: list[str], held: list[dict[str, Any]]) -> float:
    """The share of answers equal to their conversation's own answer (its last message)."""
    right = sum(a == c["messages"][-1]["content"] for a, c in zip(answers, held, strict=True))
    return right / len(held)


@dataclass
class ChatVariant:
    name: str
    steps: int
    answers: list[str]
    accuracy: float
    seconds: float


def run_chat_bench(s: ChatBenchSettings | None = None, corpus: list[str] | None = None, quiet: bool = False,
                   folder: Path | None = None) -> dict[str, Any]:
    """Generate the task, pretrain the base, fine-tune it masked and unmasked, and score all three on the held-out
    questions; print a table whose last line is the masked model's accuracy (unless `quiet`); return the report
    (the held-out conversations and each variant's answers with it). Works in `folder` (default: a temporary one)."""
    import torch

    from gptlab.bench.timing import LoadWatch
    from gptlab.runtime import device_name, set_threads

    s = s or ChatBenchSettings()
    set_threads()
    watch = LoadWatch()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(folder or tmp)
        where.mkdir(parents=True, exist_ok=True)
        train, held = make_conversations(s)
        jsonl = write_jsonl(where / "conversations.jsonl", train)
        write_jsonl(where / "held-out.jsonl", held)
        longest = s.max_len + 2
        base, base_seconds = pretrain_base(where, s, corpus)
        t = time.perf_counter()
        answers = plain_answers(base, held, longest)
        variants = [ChatVariant("base before fine-tuning (plain-text prompt)", s.base_steps, answers,
                            accuracy(answers, held), base_seconds + time.perf_counter() - t)]
        for loss, name in (("all", "fine-tuned, loss on every token (no mask)"),
                           ("assistant", "fine-tuned, loss on the assistant's tokens (mask)")):
            run, seconds = finetune(where, base, jsonl, loss, s)
            t = time.perf_counter()
            answers = chat_answers(run, held, longest)
            variants.append(ChatVariant(name, s.steps, answers, accuracy(answers, held),
                                    seconds + time.perf_counter() - t))
    load = watch.stop()
    report = {"device": device_name(torch.device("cpu")), "threads": torch.get_num_threads(), "settings": s,
              "held": held, "variants": variants, "load": load.line(), "load_report": load.report(), "busy": load.busy}
    if not quiet:
        print_chat_report(report)
    return report


def print_chat_report(report: dict[str, Any]) -> None:
    s, variants = report["settings"], report["variants"]
    print(f"{report['device']}, {report['threads']} threads; {s.train} training conversations, {len(report['held'])} "
          f"held-out questions: reverse a word of {s.min_len}-{s.max_len} letters (seed {s.seed}); a char GPT "
          f"{s.n_layer}x{s.n_embd} pretrained {s.base_steps} steps on Tiny Shakespeare, fine-tuned {s.steps} steps")
    print(f"{'variant':<52} {'steps':>6} {'accuracy':>9} {'seconds':>8}")
    for v in variants:
        print(f"{v.name:<52} {v.steps:>6} {v.accuracy:>9.1%} {v.seconds:>8.1f}")
    print("seconds: training and answering (the base: its pretraining); steps: the base's pretraining, or "
          "fine-tuning steps from it")
    print(report["load_report"])
    masked = variants[-1]
    print(f"chat fine-tuning with the mask: {masked.accuracy:.1%} of held-out questions answered exactly "
          f"(no mask {variants[1].accuracy:.1%}, before fine-tuning {variants[0].accuracy:.1%})")
