"""gptlab as a model of EleutherAI's lm-evaluation-harness: `import gptlab.tasks.harness` registers "gptlab", so
that any of the harness's tasks runs on a gptlab run:

    import lm_eval, gptlab.tasks.harness
    lm_eval.simple_evaluate(model="gptlab", model_args="run=runs/char-quick,precision=fp32", tasks=["hellaswag"])

or `gptlab eval --lm-eval TASKS`. Log-likelihoods go through tasks/score.py (a context shared by several
continuations is prefilled once), rolling log-likelihoods through the harness's own windows, generation through the
engine (greedy, cut at the first stop string). Needs the `eval` extra (lm-eval).

A tokenizer without an end-of-text token (char-level) has nothing to put before a text that has no context: there
an empty context, and a rolling text, are scored from their second token on (the first token is the context).
"""

from __future__ import annotations

from pathlib import Path

import torch
from lm_eval import utils as harness_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from gptlab.config import SampleConfig
from gptlab.engine import generate_batch
from gptlab.errors import GptlabError
from gptlab.tasks.score import score_pairs

DEFAULT_MAX_GEN_TOKS = 256  # the harness's default for generation requests without max_gen_toks


@register_model("gptlab")
class GptlabLM(TemplateLM):
    """A gptlab run (its best checkpoint) or a model and tokenizer given directly, in `precision`. The harness's
    other arguments (batch_size, max_batch_size, ...) are taken and unused: score_pairs makes its own batches."""

    def __init__(self, run: str | Path | None = None, precision: str = "fp32", device: str = "cpu",
                 model: torch.nn.Module | None = None, tokenizer=None, **_: object):
        super().__init__()
        self.checkpoint = None  # the run's checkpoint the weights came from (None: a model given directly)
        if model is None:
            from gptlab.inference.loading import load_for_inference

            if run is None:
                raise GptlabError("the gptlab harness model needs a run: model_args=run=RUN")
            ready = load_for_inference(run, device, precision, decode=False)
            model, tokenizer, precision = ready.model.model, ready.tokenizer, ready.precision
            self.checkpoint = ready.checkpoint
        self.model, self.tokenizer, self.precision = model.eval(), tokenizer, precision
        self.max_length = model.config.block_size

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eot_id

    @property
    def prefix_token_id(self) -> int | None:
        return self.tokenizer.eot_id

    @property
    def tokenizer_name(self) -> str:
        return f"gptlab-{self.tokenizer.kind}"

    def tok_encode(self, string: str, **_: object) -> list[int]:
        return self.tokenizer.encode(string, allow_special=True)

    def tok_decode(self, tokens: list[int], **_: object) -> str:
        return self.tokenizer.decode(tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.prefix_token_id is not None:
            return super().loglikelihood(requests, disable_tqdm)
        pairs = []
        for context, continuation in (req.args for req in requests):
            if context:
                pairs.append(((context, continuation), *self._encode_pair(context, continuation)))
                continue
            ids = self.tok_encode(continuation)  # no end-of-text token: the first token is the context
            if len(ids) < 2:
                raise GptlabError("a continuation of one token with no context cannot be scored by a model "
                                  "without an end-of-text token (char-level): give it a context")
            pairs.append(((context, continuation), ids[:1], ids[1:]))
        return self._loglikelihood_tokens(pairs, disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_: object) -> list[tuple[float, bool]]:
        scored = score_pairs(self.model, [(list(context), list(continuation))
                                          for _, context, continuation in requests], self.precision)
        out = []
        for (key, _, _), s in zip(requests, scored):
            result = (s.loglikelihood, s.greedy)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
            out.append(result)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, in the harness's windows of max_length tokens (each token
        predicted once); after the end-of-text token, or from the second token where the tokenizer has none."""
        out = []
        for (text,) in (req.args for req in requests):
            ids = self.tok_encode(text)
            prefix = self.prefix_token_id
            if prefix is None:
                prefix, ids = ids[0], ids[1:]
            windows = [harness_utils.make_disjoint_window(w) for w in harness_utils.get_rolling_token_windows(
                token_list=ids, prefix_token=prefix, max_seq_len=self.max_length, context_len=1)]
            total = sum(ll for ll, _ in self._loglikelihood_tokens([(None, c, t) for c, t in windows]))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each cut before the first of its stop strings (`until`, and the end-of-text
        token's text), at most max_gen_toks tokens; the context keeps its last max_length - max_gen_toks tokens."""
        out = []
        for context, kwargs in (req.args for req in requests):
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            steps = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            keep = self.max_length - steps
            if keep < 1:
                raise GptlabError(f"max_gen_toks {steps} leaves no room for a context in the model's "
                                  f"{self.max_length} tokens")
            ids = self.tok_encode(context)[-keep:]
            if not ids and self.prefix_token_id is None:
                raise GptlabError("an empty context cannot be continued by a model without an end-of-text token "
                                  "(char-level): give it a context")
            ids = ids or [self.prefix_token_id]
            new = [row[0] for row in generate_batch(self.model, [ids], SampleConfig(max_new_tokens=steps,
                                                                                       temperature=0))]
            if self.eot_token_id is not None and self.eot_token_id in new:
                new = new[:new.index(self.eot_token_id)]
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[:text.index(stop)]
            self.cache_hook.add_partial("generate_until", (context, kwargs), text)
            out.append(text)
        return out
