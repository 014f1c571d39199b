"""The `gptlab chat` verb: a conversation with a run trained on conversations, in the terminal. Each turn renders
the whole conversation with the run's chat template (tokenizer.ChatTokenizer.render), cut to the context by
chat.fit_context, and streams the answer through the generation `gptlab sample` runs (textstream.TextStream)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from gptlab.cli.common import (
    add_config_flags,
    add_constraint_flags,
    add_prefix_cache_flag,
    announce,
    command,
    constraint,
    prefix_cache,
)
from gptlab.cli.verbs import add_inference_flags, sample_config
from gptlab.config import SEED_LIMIT, SampleConfig
from gptlab.errors import GptlabError

PROMPT, ANSWER = "you> ", "assistant> "
COMMANDS_HINT = "/reset, /system TEXT, /exit (or Ctrl-D)"
HELP = "talk with a run trained on conversations: your turns at a prompt, its answers streamed as they come"
DESCRIPTION = f"""{HELP}. Each turn the whole conversation (the system message, then the turns kept) is rendered
with the run's chat template and the model answers it; the answer, its text up to its end of turn (or up to a role
marker, which a message cannot hold), joins the conversation. At the prompt: /reset forgets the conversation (the
system message stays), /system TEXT sets or replaces the system message (/system alone removes it), /exit, /quit or
Ctrl-D (end of input) end with exit 0. Ctrl-C during an answer stops it, and what it had said stays in the
conversation; Ctrl-C at the prompt ends with exit 130. When the conversation and --max-new-tokens (default: half
the model's context) no longer fit the context, its oldest whole turns are dropped (the system message stays) and
one line says how many messages. Seeds: answer n, counted from 1 since the start or the last /reset, is drawn with
--seed + n - 1 by the generation `gptlab sample` runs, so answer 1 is what `gptlab sample --seed S` (and the
server, for the same messages and seed) gives for the conversation's prompt. Input that is not a terminal (a pipe,
a file) is echoed after each prompt, so the transcript reads as the conversation."""


@command("chat", HELP)
def cmd_chat(args: argparse.Namespace) -> int:
    from gptlab.inference.loading import load_for_inference
    from gptlab.runs import latest_run
    from gptlab.runtime import resolve_device, set_threads
    from gptlab.tokenizer import chat_of

    set_threads()
    sample_config(args)  # a bad sampling flag is refused before the model is loaded
    found = []  # the run's chat tokenizer and the answers' constraint; refused before the model is prepared
    run = args.run or latest_run()
    ready = load_for_inference(run, resolve_device(args.device), args.precision,
                               check=lambda tokenizer: found.extend([chat_of(tokenizer), constraint(args, tokenizer)]))
    block_size = ready.model.config.block_size
    chat = Chat(ready.model, found[0], chat_config(args, block_size), block_size, args.system,
                prefix_cache(args.prefix_cache_mb), steer=found[1])
    announce(ready)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history at the prompt)
        except ImportError:
            pass
    print(f"gptlab: chatting with {run}: {COMMANDS_HINT}", file=sys.stderr)
    return chat.loop()


def chat_config(args: argparse.Namespace, block_size: int) -> SampleConfig:
    """The sampling settings of the answers: the flags, and --max-new-tokens by default half the context (the rest
    holds the conversation). An answer ends at the end of its turn or at any role marker (tokenizer.ChatTokenizer's
    end_ids: the model starting another turn ends its own)."""
    cfg = sample_config(args, max_new_tokens=max(1, block_size // 2))
    if cfg.max_new_tokens >= block_size:
        raise GptlabError(f"--max-new-tokens {cfg.max_new_tokens} leaves no room for the conversation in the model's "
                          f"context of {block_size} tokens; give at most {block_size - 1}")
    return cfg


class Chat:
    """A conversation read from stdin and answered on stdout (notices on stderr). `turns` holds the user's and the
    assistant's messages, `system` the system message (None: none); `answers` counts the answers since the start
    or the last /reset (answer n draws with cfg.seed + n - 1)."""

    def __init__(self, model, tokenizer, cfg: SampleConfig, block_size: int, system: str | None = None,
                 prefix=None, steer=None):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.steer = steer  # every answer obeys its grammar (--json-schema, --regex, --grammar)
        self.prefix = prefix  # a PrefixCache kept between turns: the conversation so far is not computed again
        self.room = block_size - cfg.max_new_tokens  # prompt tokens that leave room for a whole answer
        self.system = system or None
        self.turns: list[dict[str, str]] = []
        self.answers = 0

    def messages(self) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def loop(self) -> int:
        """Read and answer until /exit, /quit or the end of input (0) or Ctrl-C at the prompt (130)."""
        while True:
            try:
                line = _read_line()
            except KeyboardInterrupt:
                _show("\n")
                return 130
            if line is None:
                _show("\n")
                return 0
            if line.startswith("/"):
                if self.command(line):
                    return 0
            elif line.strip():
                self.turn(line)

    def command(self, line: str) -> bool:
        """Do the command on `line`; True when it ends the conversation."""
        name, _, text = line.partition(" ")
        if name in ("/exit", "/quit"):
            return True
        if name == "/reset":
            self.turns, self.answers = [], 0
            _notice("gptlab: the conversation is forgotten" + (" (the system message stays)" if self.system else ""))
        elif name == "/system":
            self.system = text or None
            _notice("gptlab: system message " + ("set" if self.system else "removed"))
        else:
            _notice(f"gptlab: error: unknown command {name}; use {COMMANDS_HINT}, or type a message")
        return False

    def turn(self, text: str) -> None:
        """Answer the user's `text`; a message the template cannot hold is refused in one line and forgotten."""
        self.turns.append({"role": "user", "content": text})
        try:
            ids = self.prompt()
        except GptlabError as exc:
            self.turns.pop()
            _notice(f"gptlab: error: {exc}")
            return
        self.answer(ids)

    def prompt(self) -> list[int]:
        """The ids the model answers: the conversation, its oldest whole turns dropped for good where it no longer
        fits the room the context leaves (said in one line)."""
        from gptlab.chat import fit_context

        kept, dropped = fit_context(self.messages(), self.tokenizer, self.room)
        if dropped:
            self.turns = [m for m in kept if m["role"] != "system"]
            _notice(f"gptlab: the conversation outgrew the model's context: dropped its {dropped} oldest "
                f"message{'s' if dropped > 1 else ''}")
        return self.tokenizer.render(kept, add_generation_prompt=True)[0]

    def answer(self, ids: list[int]) -> None:
        """Stream the answer to `ids` (Ctrl-C stops it) and add what it said to the conversation."""
        from gptlab.textstream import TextStream

        cfg = replace(self.cfg, seed=(self.cfg.seed + self.answers) % SEED_LIMIT)
        said, stopped = "", False
        _show(ANSWER)
        try:
            stream = TextStream(self.model, self.tokenizer, [ids], cfg, prefix_cache=self.prefix,  # as `gptlab sample`
                                steer=self.steer)
            for pieces in stream:
                _show(pieces[0])
                said += pieces[0]
        except KeyboardInterrupt:
            stopped = True
        _show("\n")
        self.turns.append({"role": "assistant", "content": said})
        self.answers += 1
        if stopped:
            _notice("gptlab: answer stopped; what it said stays in the conversation")


def _read_line() -> str | None:
    """The next line typed after the prompt, None at the end of input. A terminal's line is read by input() (line
    editing); other input is echoed after the prompt so the transcript shows it."""
    if sys.stdin.isatty():
        try:
            return input(PROMPT)
        except EOFError:
            return None
    _show(PROMPT)
    line = sys.stdin.readline()
    if not line:
        return None
    line = line.rstrip("\r\n")
    _show(line + "\n")
    return line


def _show(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _notice(line: str) -> None:
    """A notice, on stderr (stdout holds the conversation), after what stdout has shown."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)


def add_chat(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.add_argument("--run", help="run folder (default: the most recent under runs/)")
    p.add_argument("--system", metavar="TEXT", help="start with this system message (change it with /system TEXT)")
    add_inference_flags(p)
    add_prefix_cache_flag(p)
    add_constraint_flags(p)
    add_config_flags(p, SampleConfig, "sampling settings (each answer is a sample; see the seeds above)")
