"""Conversations: OpenAI's messages checked once for every door they come in by (a file of conversations, the
server's chat route, `gptlab chat`), a conversation cut to a context by dropping its oldest whole turns, and a
model's vocabulary grown by the chat markers when it is fine-tuned on conversations. Rendering messages into ids is
the chat tokenizer's (tokenizer.ChatTokenizer.render)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gptlab.errors import GptlabError
from gptlab.tokenizer import ROLES, ChatTokenizer, Tokenizer

if TYPE_CHECKING:  # torch is imported where a tensor is made: checking messages (the server's --help) needs none
    import torch


def check_messages(messages: Any, where: str = "the conversation", training: bool = False) -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} (content given as OpenAI's text parts is joined); GptlabError
    naming `where` when it is empty, a message is not an object, a role is unknown or a content is missing. For
    training it must also end with an assistant turn (the answer it learns)."""
    if not isinstance(messages, list) or not messages:
        raise GptlabError(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for n, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise GptlabError(f"{where}: message {n} is not an object with a role and a content")
        role = message.get("role")
        if role not in ROLES:
            raise GptlabError(f"{where}: message {n} has the unknown role {role!r}; use system, user or assistant")
        out.append({"role": role, "content": _content(message.get("content"), f"{where}: message {n}")})
    if training and out[-1]["role"] != "assistant":
        raise GptlabError(f"{where}: the conversation ends on a {out[-1]['role']} turn; a training conversation ends "
                          "with the assistant's answer")
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)  # OpenAI's content parts, text only
    if content is None:
        raise GptlabError(f"{where} has no content; give it a \"content\" string")
    raise GptlabError(f"{where} has a content that is not text; give a string (or text parts)")


def fit_context(messages: Sequence[dict[str, str]], tokenizer: ChatTokenizer,
                room: int) -> tuple[list[dict[str, str]], int]:
    """The conversation with its oldest whole turns dropped (a turn: a message and the assistant's answers after
    it; system messages are kept) until its prompt for the next answer takes at most `room` tokens, and how many
    messages were dropped; GptlabError when even the system messages and the last turn do not fit."""
    kept = list(messages)
    dropped = 0
    while len(tokenizer.render(kept, add_generation_prompt=True)[0]) > room:
        turns = [i for i, m in enumerate(kept) if m["role"] != "system"]
        end = turns[0] + 1 if turns else 0
        while end < len(kept) and kept[end]["role"] == "assistant":
            end += 1
        if not turns or end >= len(kept):
            raise GptlabError(f"the conversation's system messages and last turn alone take more than the {room} "
                              "tokens the context leaves; shorten them or start again (/reset)")
        kept = kept[:turns[0]] + kept[end:]
        dropped += end - turns[0]
    return kept, dropped


def rows_added(source: Tokenizer, tokenizer: Tokenizer) -> bool:
    """Whether a model fine-tuned from one with tokenizer `source` onto conversations tokenized by `tokenizer` adds
    the chat markers' rows: `tokenizer` is `source` with the chat template (GptlabError for another one)."""
    if not isinstance(tokenizer, ChatTokenizer) or isinstance(source, ChatTokenizer):
        return False
    if tokenizer.base.to_dict() != source.to_dict():
        raise GptlabError(f"the conversations were prepared with a {tokenizer.kind} tokenizer of "
                          f"{tokenizer.base.vocab_size} ids that is not the source model's ({source.kind}, "
                          f"{source.vocab_size} ids); prepare them with --tokenizer-from the source")
    return True


def grow_vocab(tensors: dict[str, torch.Tensor], keep: int, vocab_size: int) -> dict[str, torch.Tensor]:
    """`tensors` with the token embedding (and an untied LM head) grown to `vocab_size` rows, the rows from `keep`
    on (new tokens: the chat markers; or a padded vocabulary's unused rows) set to the mean of the first `keep`:
    a new token starts as the average token, neither near nor far from any. In place, returned."""
    import torch

    for name in ("transformer.wte.weight", "lm_head.weight"):
        if name in tensors:
            old = tensors[name]
            grown = torch.empty(vocab_size, old.shape[1], dtype=old.dtype)
            grown[:keep] = old[:keep]
            grown[keep:] = old[:keep].double().mean(0).to(old.dtype)
            tensors[name] = grown
    return tensors
