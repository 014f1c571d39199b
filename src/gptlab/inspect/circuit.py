"""A patching study from text, as `gptlab inspect patch` runs it: a clean and a corrupted prompt of the same length
in tokens, the answer and the wrong answer one token each, then every sweep asked for (activation patching, and
attribution patching beside it when asked) and the direct logit attribution of the clean prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gptlab.errors import GptlabError
from gptlab.inspect.hooks import Hooked
from gptlab.inspect.patching import PATCH_KINDS, LogitParts, PatchResult, activation_patch, attribution_patch, \
    direct_logit_attribution, logit_diff
from gptlab.inspect.trace import token_labels
from gptlab.model import GPT
from gptlab.tokenizer import Tokenizer

DEFAULT_SWEEPS = ("resid_pre", "attn_out", "mlp_out", "head_out")


@dataclass(frozen=True)
class Study:
    """What `inspect patch` found: the sweeps (activation, then attribution where asked), the direct logit
    attribution of the clean prompt, and each position's token as a label."""

    activation: list[PatchResult]
    attribution: list[PatchResult]
    parts: LogitParts
    tokens: list[str]


def one_token(tokenizer: Tokenizer, text: str, flag: str) -> int:
    """The id of `text`, which must be exactly one token of this tokenizer."""
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        shown = " | ".join(token_labels(tokenizer, ids)) or "nothing"
        raise GptlabError(f"{flag} {text!r} is {len(ids)} tokens ({shown}) for this run's tokenizer; give one token "
                          "(with BPE a word usually carries its leading space: ' Mary')")
    return ids[0]


def pair_ids(tokenizer: Tokenizer, clean: str, corrupt: str, block_size: int) -> tuple[list[int], list[int]]:
    """Both prompts as ids, of the same length and within the context."""
    a, b = tokenizer.encode(clean), tokenizer.encode(corrupt)
    if len(a) != len(b) or not a:
        raise GptlabError(f"--clean is {len(a)} tokens and --corrupt {len(b)}: patching pairs position with position, "
                          "so change one word for another of as many tokens (with a char run: as many characters)")
    if len(a) > block_size:
        raise GptlabError(f"the prompts are {len(a)} tokens, longer than the model's context of {block_size}")
    return a, b


def check_sweeps(sweeps: Sequence[str]) -> list[str]:
    unknown = [s for s in sweeps if s not in PATCH_KINDS]
    if unknown or not sweeps:
        raise GptlabError(f"unknown sweep {', '.join(unknown) or '(none)'}: choose from {', '.join(PATCH_KINDS)}")
    return list(dict.fromkeys(sweeps))


def study(model: GPT, tokenizer: Tokenizer, clean: str, corrupt: str, answer: str, wrong: str,
          sweeps: Sequence[str] = DEFAULT_SWEEPS, attribution: bool = False) -> Study:
    """Patch every activation of each sweep from the clean run into the corrupted one, the metric the logit
    difference answer - wrong after the last token; attribution patching beside it when `attribution`."""
    sweeps = check_sweeps(sweeps)
    a, w = one_token(tokenizer, answer, "--answer"), one_token(tokenizer, wrong, "--wrong")
    if a == w:
        raise GptlabError(f"--answer and --wrong are the same token ({answer!r}): the logit difference is 0")
    ids = pair_ids(tokenizer, clean, corrupt, model.config.block_size)
    clean_ids, corrupt_ids = (torch.tensor([i], device=model.transformer.wte.weight.device) for i in ids)
    hooked, metric = Hooked(model), logit_diff(a, w)
    acts = [activation_patch(hooked, clean_ids, corrupt_ids, metric, kind) for kind in sweeps]
    attrs = [attribution_patch(hooked, clean_ids, corrupt_ids, metric, kind) for kind in sweeps] if attribution \
        else []
    return Study(acts, attrs, direct_logit_attribution(hooked, clean_ids, a, w), token_labels(tokenizer, ids[0]))
