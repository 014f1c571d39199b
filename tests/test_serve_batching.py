"""Continuous batching in the engine (gptlab.engine.RunningBatch): rows join a running batch and leave it between
decode steps, each with its own settings and generator, and a row's tokens are bitwise the same alone or beside any
other rows (the server's promise), and the same as `generate_batch` (`gptlab sample`)."""

from dataclasses import replace

import pytest
import torch
from helpers import tiny_config

from gptlab.config import SampleConfig
from gptlab.engine import RunningBatch, generate_batch, one_thread, row_seed
from gptlab.inference.prefix_cache import prompt_pass
from gptlab.inference.loading import prepare_for_inference
from gptlab.model import GPT
from gptlab.runtime import bf16_supported

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=65, block_size=32)


@pytest.fixture(autouse=True)
def _one_thread():  # as test_engine's
    with one_thread():
        yield


def prepared(precision="fp32"):
    """A model whose next token depends on the context: a fresh init's hardly does (its attention is near uniform,
    two unrelated contexts give nearly the same next-token distribution and the same greedy token), so a row
    reading another row's cache would rarely change a token; its matrices x 10 make the context matter."""
    torch.manual_seed(0)
    model = GPT(tiny_config(**SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0 if p.dim() == 2 else 1.0)
    return prepare_for_inference(model, precision)


def alone(model, prompt, cfg, n=1):
    return [list(r) for r in zip(*generate_batch(model, [prompt], cfg, n))]


def drive(batch, joins):
    """Run `batch`, joining joins[step] = [(prompt, cfg, n), ...] before each step; every row's ids, by join."""
    out, step = {}, 0
    while step in joins or batch.rows or any(k > step for k in joins):
        for prompt, cfg, n in joins.get(step, []):
            for i, row in enumerate(batch.join(prompt, cfg, n)):
                out[(prompt, cfg.seed, i)] = (row, [])
        by_row = {id(r): key for key, (r, _) in out.items()}
        for row, token, _ in batch.sample():
            out[by_row[id(row)]][1].append(token)
        batch.advance()
        step += 1
    return {key: ids for key, (_, ids) in out.items()}


@pytest.mark.device_path("fused decode (native)")
def test_the_fused_steps_many_row_kernels_agree_bitwise_at_any_batch_size(fused_kernel):
    model = prepared()
    rows = {}
    for R in (2, 3, 5, 8, 9, 16):
        with torch.inference_mode():
            mine = model.new_kv_cache(1, max_len=32)
            prompt_pass(model.model, mine, [1, 2, 3, 4, 5], None)
            cache = model.new_kv_cache(R, max_len=32)
            for i in range(R):
                other = model.new_kv_cache(1, max_len=32)
                prompt_pass(model.model, other, [7] * (2 + i), None)
                cache.replace_rows(torch.tensor([i]), other)
            cache.replace_rows(torch.tensor([R - 1]), mine)  # the row watched sits last, beside ragged rows
            rows[R] = [model.decoder.step(torch.tensor([9] * R), cache)[R - 1].clone() for _ in range(3)]
    for R, logits in rows.items():
        assert all(torch.equal(a, b) for a, b in zip(logits, rows[2])), f"{R} rows differ from 2"


@pytest.mark.device_path("fused decode (native)")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_a_seeded_row_gives_the_same_tokens_alone_or_joining_a_running_batch(fused_kernel, precision):
    if precision == "bf16" and not bf16_supported(torch.device("cpu")):
        pytest.skip("no native bf16 on this CPU")
    model = prepared(precision)
    if not model.fused:
        pytest.skip(f"no fused {precision} step on this CPU")
    mine = SampleConfig(max_new_tokens=60, temperature=0.9, top_p=0.9, seed=7)  # 60 > 32: the window slides
    others = [SampleConfig(max_new_tokens=k, temperature=t, top_k=5, presence_penalty=0.5, seed=s)
              for k, t, s in ((10, 1.0, 1), (40, 0.0, 2), (25, 1.3, 3))]
    reference = alone(model, (1, 2, 3), mine)[0]
    joins = {0: [((4, 5, 6, 7), others[0], 1)], 3: [((1, 2, 3), mine, 1), ((9,) * 20, others[1], 2)],
             12: [((3,), others[2], 3)]}
    got = drive(RunningBatch(model), joins)
    assert got[((1, 2, 3), 7, 0)] == reference
    for prompt, cfg, n in [j for js in joins.values() for j in js]:
        for i in range(n):  # every row is what it gives alone too, sample i with seed + i
            assert got[(prompt, cfg.seed, i)] == alone(model, prompt, replace(cfg, seed=row_seed(cfg.seed, i)))[0]


def test_sample_i_of_n_is_one_sample_with_seed_plus_i():
    model = GPT(tiny_config()).eval()
    cfg = SampleConfig(max_new_tokens=20, temperature=1.0, seed=5)
    three = alone(model, [1, 2], cfg, 3)
    assert len({tuple(r) for r in three}) == 3
    for i, row in enumerate(three):
        assert row == alone(model, [1, 2], SampleConfig(max_new_tokens=20, temperature=1.0, seed=5 + i))[0]
    assert row_seed(2**63 - 1, 1) == 0


def test_rows_leave_and_free_their_cache_rows():
    model = prepared()
    batch = RunningBatch(model)
    a = batch.join([1, 2, 3], SampleConfig(max_new_tokens=50, temperature=0), 2)
    b = batch.join([4], SampleConfig(max_new_tokens=3, temperature=0))
    assert batch.cache is None  # laid out once, at the next step, for every row that joined
    for _ in range(3):
        batch.sample()
        batch.advance()
        assert len(batch.cache.pos) == 3 or batch.rows == a
    assert batch.rows == a and len(batch.cache.pos) == 2  # b finished and left
    batch.leave(a[:1])
    batch.sample()
    batch.advance()
    assert batch.rows == a[1:] and len(batch.cache.pos) == 1  # one row left, one cache row: no pad row
    batch.leave(a[1:])
    batch.advance()
    assert batch.rows == [] and batch.cache is None and b[0].left == 0
