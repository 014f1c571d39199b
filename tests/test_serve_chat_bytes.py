"""Chat completions whose answer splits characters across tokens (issue 42, behaviour 6a), through the official
`openai` client against a live server: a byte-level (GPT-2) model whose likeliest tokens are halves of "é" and "€"
(b"\\xc3", b"\\xa9", b"\\xe2", b"\\x82\\xac"). A half character's text is "" until the next token completes it, yet
OpenAI reports every token with its bytes, so the streamed answer must carry the same logprob entries as the
non-streamed one (the plain path), each entry's logprob must be the model's own log-softmax worked out here from
the plain forward, the ids must be the ones a reference sampler draws by hand, and the entries' bytes joined must
be the answer's UTF-8."""

import codecs

import numpy as np
import pytest
import torch
from helpers import reference_probs, reference_window

from gptlab.config import ModelConfig, SampleConfig
from gptlab.inference.loading import prepare_for_inference
from gptlab.model import GPT
from gptlab.serve.api import Limits
from gptlab.serve.app import Served, make_app
from gptlab.serve.server import start_server
from gptlab.tokenizer import ChatTokenizer, GPT2Tokenizer, gpt2_ranks

openai = pytest.importorskip("openai", reason="no openai client (pip install -e '.[test]')")
MESSAGES = [{"role": "user", "content": "Say café in euros."}]
PREFERRED = (b"\xc3", b"\xa9", b"\xe2", b"\x82\xac", b" caf")  # GPT-2 tokens: halves of "é" and of "€", a word


@pytest.fixture(scope="module")
def byte_chat():
    """(tokenizer, plain model, the openai client of a live server over its packed twin)."""
    tokenizer = ChatTokenizer(GPT2Tokenizer())
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1, n_head=2, n_embd=32,
                            dropout=0.0)).eval()
    ranks = gpt2_ranks()
    with torch.no_grad():
        direction = torch.nn.functional.normalize(torch.randn(32), dim=0)
        model.transformer.ln_f.bias.copy_(3 * direction)
        for piece in PREFERRED:  # their logits pulled up alike: drawn in a mix, whole characters and broken ones
            model.transformer.wte.weight[ranks[piece]] += 3 * direction
    served = Served("bytes", prepare_for_inference(model, "fp32"), tokenizer, model.num_params(), lambda: model)
    running = start_server(make_app(served, Limits(max_tokens=40)))
    yield tokenizer, model, openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
    running.stop()


@torch.no_grad()
def drawn_by_hand(tokenizer, model, prompt, seed, max_tokens):
    """The ids next_token's documented draw takes (one uniform number a step from a generator seeded with `seed`,
    placed in the float64 cumulative sum of the plain forward's softmax), the end of turn included."""
    cfg, drawn = SampleConfig(max_new_tokens=max_tokens, temperature=1.0, seed=seed), []
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_tokens):
        logits = model(torch.tensor([reference_window(prompt, drawn, model.config.block_size)]))[0][0, -1]
        probs, _ = reference_probs(logits.double().numpy(), np.zeros(len(logits)), cfg)
        drawn.append(int(np.searchsorted(np.cumsum(probs), torch.rand(1, generator=generator).item(), side="right")))
        if drawn[-1] in tokenizer.end_ids:
            break
    return drawn


def test_a_streamed_chat_keeps_the_logprobs_of_tokens_that_are_half_a_character(byte_chat):
    tokenizer, model, client = byte_chat
    seed, max_tokens = 5, 30
    prompt = tokenizer.render(MESSAGES, add_generation_prompt=True)[0]
    drawn = drawn_by_hand(tokenizer, model, prompt, seed, max_tokens)
    pieces = [tokenizer.decode_bytes([i]) for i in drawn]
    # the case under test happens: "€" and "é" spelled by two tokens each, the first showing nothing, and the answer
    # cut by the length after a lead byte (the half character the end flushes as U+FFFD)
    assert b"\xe2\x82\xac" in b"".join(pieces) and b"\xc3\xa9" in b"".join(pieces), pieces
    assert pieces[-1] == b"\xe2" and len(drawn) == max_tokens
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # what each token releases, by Python's codec
    released = [utf8.decode(piece, final=n == len(pieces) - 1) for n, piece in enumerate(pieces)]
    assert released.count("") >= 3  # lead bytes waiting for the rest of their character
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + drawn]))[0][0, len(prompt) - 1:-1], dim=-1)
    best = logp.topk(2)

    ask = dict(model="bytes", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=max_tokens, logprobs=True,
               top_logprobs=2)
    plain = client.chat.completions.create(**ask)
    whole = plain.choices[0].logprobs.content
    assert [list(e.bytes) for e in whole] == [list(p) for p in pieces]  # every token, with its bytes
    assert [e.logprob for e in whole] == pytest.approx([float(logp[n, i]) for n, i in enumerate(drawn)], abs=1e-4)
    assert [[list(t.bytes) for t in e.top_logprobs] for e in whole] == \
        [[list(tokenizer.decode_bytes([i])) for i in row] for row in best.indices.tolist()]
    assert [t.logprob for e in whole for t in e.top_logprobs] == pytest.approx(best.values.flatten().tolist(),
                                                                               abs=1e-4)
    content = plain.choices[0].message.content
    assert content == "".join(released) and plain.choices[0].finish_reason == "length"
    assert plain.usage.completion_tokens == max_tokens

    chunks = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
    streamed = [e for c in chunks if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.bytes, e.logprob, e.top_logprobs) for e in streamed] == \
        [(e.token, e.bytes, e.logprob, e.top_logprobs) for e in whole]  # the plain path's entries, in order
    assert [(c.delta.content, list(c.logprobs.content[0].bytes)) for c in chunks if c.logprobs] == \
        [(text, list(piece)) for text, piece in zip(released, pieces)]  # one delta a token, "" or not
    assert "".join(c.delta.content or "" for c in chunks) == content and chunks[-1].finish_reason == "length"
