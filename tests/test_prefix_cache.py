"""The exact prefix cache (gptlab.inference.prefix_cache): with it, every row's logits, at every step, are bit for
bit those without it (the same chunked prompt pass with a cache that keeps nothing), in fp32, bf16 and int8, alone
and in a batch, with windows that slide; what it reuses (whole chunks before the last token, exact keys), its budget
(never exceeded, least recently used first, leaves before their parents) and whose blocks it may serve."""

import pytest
import torch
from helpers import tiny_config

from gptlab.config import SampleConfig
from gptlab.engine import RunningBatch, generate_uncached, one_thread
from gptlab.errors import GptlabError
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.prefix_cache import PROMPT_CHUNK, PrefixCache, prompt_pass
from gptlab.inference.prepared import InferenceModel, TorchStep
from gptlab.model import GPT
from gptlab.runtime import bf16_supported

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=65, block_size=40)
CHUNK = 4


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def trained_like(precision="fp32", seed=0):
    """A model away from its init (matrices x 10, LayerNorms and biases moved) so that context matters."""
    torch.manual_seed(seed)
    model = GPT(tiny_config(**SHAPE)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    return prepare_for_inference(model, precision)


def run(model, prefix, requests, steps_between=2):
    """Requests [(prompt, cfg, n)] joining one RunningBatch `steps_between` steps apart (a new one on `prefix`, a
    PrefixCache, or `prefix` itself, a RunningBatch); every row's logits at every step and its tokens, and each row's
    cached count, in join order."""
    batch = prefix if isinstance(prefix, RunningBatch) else RunningBatch(model, prefix)
    logits, tokens, cached, order = {}, {}, {}, []
    pending = list(requests)
    step = 0
    while pending or batch.rows:
        if pending and step % steps_between == 0:
            prompt, cfg, n = pending.pop(0)
            for row in batch.join(prompt, cfg, n):
                order.append(row)
                logits[row], tokens[row], cached[row] = [], [], row.cached
        for row, token, row_logits in batch.sample():
            logits[row].append(row_logits.clone())
            tokens[row].append(token)
        batch.advance()
        step += 1
    return [(logits[r], tokens[r], cached[r]) for r in order]


SYSTEM = [5, 9, 13, 2, 7, 7, 1, 30, 22, 8, 41]  # 11 tokens: two whole chunks and 3 more


def requests():
    """Shared system prompts of lengths crossing the chunk edges (≡ 0, 1, CHUNK - 1 mod CHUNK), a conversation
    continued turn by turn, unrelated prompts, greedy and seeded sampling, n > 1, and windows that slide."""
    greedy = SampleConfig(max_new_tokens=6, temperature=0)
    sampled = SampleConfig(max_new_tokens=8, temperature=0.9, top_k=20, seed=3)
    long = SampleConfig(max_new_tokens=30, temperature=0.8, seed=11)  # 14 + 30 > 40: slides
    turn1 = SYSTEM + [3, 4, 60]
    return [(SYSTEM + [3, 4], greedy, 1), (SYSTEM[:8], greedy, 1), (SYSTEM[:9], sampled, 2), (SYSTEM[:7], greedy, 1),
            (turn1, long, 1), (turn1 + [17, 18, 19, 20, 21, 22], sampled, 1), ([50, 51, 52], greedy, 1),
            (SYSTEM + [3, 4], sampled, 3), (list(range(40, 65)) + SYSTEM, greedy, 1)]


@pytest.mark.device_path("fused decode (native)")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_logits_and_tokens_with_the_cache_are_bit_for_bit_those_without(fused_kernel, precision):
    if precision == "bf16" and not bf16_supported(torch.device("cpu")):
        pytest.skip("no native bf16 on this CPU")
    model = trained_like(precision)
    if not model.fused:
        pytest.skip(f"no fused {precision} step on this CPU")
    off = run(model, PrefixCache(0, chunk=CHUNK), requests())
    cache = PrefixCache(2 ** 24, chunk=CHUNK)
    on = run(model, cache, requests())
    again = run(model, cache, requests(), steps_between=1)  # every prompt's blocks now cached, other neighbours
    for i, ((l0, t0, c0), (l1, t1, c1), (l2, t2, _)) in enumerate(zip(off, on, again)):
        assert t0 == t1 == t2, f"request row {i}"
        assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(l0, l1, l2)), f"request row {i}"
        assert c0 == 0
    assert [c for _, _, c in on][:5] == [0, 4, 8, 8, 4]  # the system prompt's whole chunks before each last token
    assert cache.stats().hit_tokens > 100


def test_a_plain_model_on_the_torch_step_is_exact_too():
    model = trained_like().model  # decoded by the torch step, one row: the same shapes with the cache or without
    cfg = SampleConfig(max_new_tokens=5, temperature=0)
    prompts = [(SYSTEM + [3, 4], cfg, 1), (SYSTEM + [3, 4, 5], cfg, 1)]
    off = run(model, PrefixCache(0, chunk=CHUNK), prompts, steps_between=100)
    on = run(model, PrefixCache(2 ** 20, chunk=CHUNK), prompts, steps_between=100)
    assert [t for _, t, _ in off] == [t for _, t, _ in on]
    assert all(torch.equal(a, b) for (la, _, _), (lb, _, _) in zip(off, on) for a, b in zip(la, lb))
    assert [c for _, _, c in on] == [0, 12]
    greedy = [list(r) for r in zip(*generate_uncached(model, [SYSTEM + [3, 4, 5]], cfg))][0]
    assert on[1][1] == greedy  # and both decode what the reference decodes


@pytest.mark.parametrize("length, reused", [(1, 0), (3, 0), (4, 0), (5, 4), (7, 4), (8, 4), (9, 8), (12, 8), (13, 12)])
def test_only_whole_chunks_before_the_last_token_are_reused(length, reused):
    model = trained_like().model
    cache = PrefixCache(2 ** 20, chunk=CHUNK)
    tokens = list(range(1, 20))
    RunningBatch(model, cache).join(tokens, SampleConfig(max_new_tokens=1))  # every whole chunk of 19 kept
    assert cache.stats().blocks == 4
    row = RunningBatch(model, cache).join(tokens[:length], SampleConfig(max_new_tokens=1))[0]
    assert row.cached == reused


def test_keys_are_the_exact_tokens_from_the_windows_start():
    model = trained_like().model
    cache = PrefixCache(2 ** 20, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=1)
    RunningBatch(model, cache).join(list(range(1, 14)), cfg)
    changed = list(range(1, 14))
    changed[5] = 60  # chunk 2 differs: only chunk 1 is reused
    assert RunningBatch(model, cache).join(changed, cfg)[0].cached == 4
    shifted = [0] + list(range(1, 13))  # the same tokens one position later: nothing is reused
    assert RunningBatch(model, cache).join(shifted, cfg)[0].cached == 0
    later = list(range(9, 14))  # the first prompt's third chunk at a window's start: not the root's, nothing reused
    assert RunningBatch(model, cache).join(later, cfg)[0].cached == 0


def test_prompt_logits_bypass_the_cache_and_are_the_rows_own():
    model = trained_like().model
    cache = PrefixCache(2 ** 20, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=1)
    prompt = list(range(1, 14))
    RunningBatch(model, cache).join(prompt, cfg)
    rows = RunningBatch(model, cache).join(prompt, cfg, 2, prompt_logits=True)
    assert rows[0].cached == 0 and rows[0].prompt_logits.shape == (13, SHAPE["vocab_size"])
    assert torch.equal(rows[0].prompt_logits[-1:], rows[0].logits)
    with torch.no_grad():
        full, _ = model(torch.tensor([prompt]))
    torch.testing.assert_close(rows[0].prompt_logits, full[0], rtol=1e-4, atol=1e-4)  # chunked, not one pass


def test_the_budget_is_never_exceeded_and_least_recently_used_leaves_go_first():
    model = trained_like().model
    block = 2 * SHAPE["n_layer"] * SHAPE["n_embd"] * CHUNK * 4  # keys and values of one chunk in fp32
    cache = PrefixCache(5 * block, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=1)
    a, b = list(range(1, 13)), list(range(20, 32))  # three whole chunks each (12 = 3 * 4)
    for prompt in (a, b, a):
        RunningBatch(model, cache).join(prompt, cfg)
        assert cache.stats().bytes <= 5 * block
    # a (3 blocks) used last; to make room for a's last block, b's leaf went (not its first chunks, nor a's)
    assert RunningBatch(model, cache).join(a + [1], cfg)[0].cached == 12
    assert RunningBatch(model, cache).join(b + [1], cfg)[0].cached == 8
    stats = cache.stats()
    assert stats.blocks <= 5 and stats.bytes <= stats.budget_bytes == 5 * block and stats.evictions >= 1


def test_a_cache_of_no_bytes_keeps_nothing_and_one_smaller_than_a_block_keeps_nothing_either():
    model = trained_like().model
    cfg = SampleConfig(max_new_tokens=1)
    for budget in (0, 100):
        cache = PrefixCache(budget, chunk=CHUNK)
        for _ in range(2):
            assert RunningBatch(model, cache).join(list(range(1, 13)), cfg)[0].cached == 0
        assert cache.stats().bytes == 0
    with pytest.raises(GptlabError, match="budget must be >= 0"):
        PrefixCache(-1)


def test_a_cache_serves_one_model_in_one_precision():
    cache = PrefixCache(2 ** 20, chunk=CHUNK)
    first = trained_like()
    RunningBatch(first, cache)
    with pytest.raises(GptlabError, match="another model"):
        RunningBatch(trained_like(seed=1), cache)
    RunningBatch(InferenceModel(first.model, TorchStep(first.model), torch.float32), cache)  # the same: served
    with pytest.raises(GptlabError, match="another model"):
        RunningBatch(InferenceModel(first.model, TorchStep(first.model), torch.bfloat16), cache)  # another precision


def test_a_slid_window_is_rebuilt_through_the_prompt_pass_and_reuses_blocks():
    model = trained_like().model
    cache = PrefixCache(2 ** 20, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=12, temperature=0)
    out = run(model, cache, [(list(range(1, 39)), cfg, 1), (list(range(1, 39)), cfg, 1)], steps_between=100)
    assert out[0][1] == out[1][1] and out[1][2] == 36
    reference = [list(r) for r in zip(*generate_uncached(model, [list(range(1, 39))], cfg))][0]
    assert out[0][1] == reference


def test_prompt_pass_fills_what_the_one_pass_forward_fills():
    model = trained_like().model
    tokens = list(range(3, 16))
    cache = model.new_kv_cache(1, max_len=20)
    with torch.no_grad():
        logits, hit = prompt_pass(model, cache, tokens, None, "last")
        whole = model.new_kv_cache(1, max_len=20)
        expected, _ = model(torch.tensor([tokens]), kv_cache=whole, last_only=True)
    assert hit == 0 and int(cache.pos[0]) == 13
    torch.testing.assert_close(logits, expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.k[:, :, :, :13], whole.k[:, :, :, :13], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("length, reused", [(63, 0), (64, 0), (65, 64), (127, 64), (128, 64), (129, 128)])
def test_the_prompt_chunk_is_crossed_below_at_and_one_past_its_edges(length, reused):
    """The real PROMPT_CHUNK (64 tokens): a window one below, at and one past a chunk's end reuses the whole chunks
    before its last token, and its logits are those without the cache."""
    torch.manual_seed(0)
    model = GPT(tiny_config(**{**SHAPE, "block_size": 140})).eval()
    tokens = torch.randint(0, SHAPE["vocab_size"], (130,)).tolist()
    cache = PrefixCache(2 ** 22)
    assert cache.chunk == PROMPT_CHUNK == 64
    cfg = SampleConfig(max_new_tokens=3, temperature=0)
    RunningBatch(model, cache).join(tokens, cfg)  # keeps chunks 1 and 2 (the third is not whole)
    on = run(model, cache, [(tokens[:length], cfg, 1)])
    off = run(model, PrefixCache(0), [(tokens[:length], cfg, 1)])
    assert on[0][2] == reused and off[0][2] == 0
    assert on[0][1] == off[0][1] and all(torch.equal(a, b) for a, b in zip(on[0][0], off[0][0]))


def test_a_used_prompt_cache_keeps_the_blocks_it_holds_and_copies_only_those_it_lacks():
    """copy_in: a one-row cache whose chunks hold blocks of an earlier prompt pass (kept or copied) is not copied
    into again where it holds the block asked for; every other chunk gets its block's keys and values."""
    model = trained_like().model
    cache = PrefixCache(2 ** 20, chunk=CHUNK)
    a = list(range(1, 14))  # chunks a0 a1 a2 (+1 token)
    b = a[:4] + list(range(30, 39))  # a0, then chunks of its own: b1 b2
    used, other = model.new_kv_cache(1), model.new_kv_cache(1)
    with torch.no_grad():
        prompt_pass(model, used, a, cache, "last")  # `used` holds a0 a1 a2
        prompt_pass(model, other, b, cache, "last")  # keeps b1 b2
    found = cache.lookup(b, 3)
    assert [blk.key[1] for blk in found] == [tuple(b[0:4]), tuple(b[4:8]), tuple(b[8:12])]
    used.k[:, :, :, :12] = 7.0  # a sentinel: only chunk 0 (a0, held) may keep it
    used.v[:, :, :, :12] = 7.0
    cache.copy_in(found, used)
    assert (used.k[:, 0, :, :4] == 7.0).all() and (used.v[:, 0, :, :4] == 7.0).all()
    for i in (1, 2):
        assert torch.equal(used.k[:, 0, :, 4 * i:4 * i + 4], found[i].k)
        assert torch.equal(used.v[:, 0, :, 4 * i:4 * i + 4], found[i].v)
    fresh = model.new_kv_cache(1)  # a cache never through a prompt pass holds nothing: every block copied
    cache.copy_in(found[:1], fresh)
    assert torch.equal(fresh.k[:, 0, :, :4], found[0].k)


def test_a_batch_reuses_its_prompt_cache_and_its_joins_equal_a_fresh_batchs():
    """One RunningBatch serving requests one after another (its one-row prompt cache used again: a long prompt then
    shorter ones over its old keys, shared chunks held, others not, prompt logits between) gives every step's logits
    bit for bit as a fresh batch without the prefix cache does for each request alone; and it allocates one prompt
    cache, not one a request."""
    model = trained_like()
    cfg = SampleConfig(max_new_tokens=3, temperature=0.8, seed=5)
    prompts = [list(range(40, 65)) + SYSTEM, SYSTEM + [3, 4], SYSTEM[:6], [50, 51], SYSTEM + [3, 4, 60, 61, 62],
               list(range(20, 37))]
    allocated = []
    new_kv_cache = InferenceModel.new_kv_cache
    def counting(self, rows, max_len=None):
        allocated.append((rows, max_len))
        return new_kv_cache(self, rows, max_len)
    batch = RunningBatch(model, PrefixCache(2 ** 20, chunk=CHUNK))
    for i, prompt in enumerate(prompts):
        if i == 3:
            expected_logits = RunningBatch(model, PrefixCache(0, chunk=CHUNK)).prompt_logits(prompts[1])
            assert torch.equal(batch.prompt_logits(prompts[1]), expected_logits)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(InferenceModel, "new_kv_cache", counting)
            (on,) = run(model, batch, [(prompt, cfg, 1)])
        (off,) = run(model, PrefixCache(0, chunk=CHUNK), [(prompt, cfg, 1)])
        assert on[1] == off[1] and all(torch.equal(a, b) for a, b in zip(on[0], off[0])), f"request {i}"
    assert allocated.count((1, None)) == 1  # the first request's prompt cache, then only the decode's layouts
    assert all(max_len < SHAPE["block_size"] for _, max_len in allocated[1:])
    assert [c for c in (run(model, batch, [(p, cfg, 1)])[0][2] for p in prompts[1:3])] == [12, 4]


BLOCK = 2 * SHAPE["n_layer"] * SHAPE["n_embd"] * CHUNK * 4  # keys and values of one chunk in fp32, in bytes


def test_a_negative_budget_is_refused_in_mb_and_0_mb_is_no_cache():
    """The one-line errors a user reads for a budget below 0 (PrefixCache's bytes shown in MB, --prefix-cache-mb's
    as given); of_mb(0) is no cache at all, of_mb(mb) a budget of mb MiB."""
    for budget, shown in ((-2 ** 20, "-1"), (-3 * 2 ** 19, "-1.5"), (-2 ** 30, "-1024")):
        with pytest.raises(GptlabError) as err:
            PrefixCache(budget)
        assert str(err.value) == f"the prefix cache's budget must be >= 0 MB, not {shown}"
    with pytest.raises(GptlabError) as err:
        PrefixCache.of_mb(-1)
    assert str(err.value) == "--prefix-cache-mb must be >= 0, not -1; 0 turns the cache off"
    assert PrefixCache.of_mb(0) is None
    assert PrefixCache.of_mb(1.5).budget == 3 * 2 ** 19 and PrefixCache.of_mb(1.5).chunk == PROMPT_CHUNK


def test_a_block_exactly_as_large_as_the_budget_is_kept_and_the_next_one_takes_its_place():
    model = trained_like().model
    cache = PrefixCache(BLOCK, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=1)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]  # one whole chunk and one token each
    RunningBatch(model, cache).join(a, cfg)
    assert cache.stats().bytes == BLOCK and cache.stats().blocks == 1
    assert RunningBatch(model, cache).join(a, cfg)[0].cached == 4
    RunningBatch(model, cache).join(b, cfg)  # a's block goes to make room
    stats = cache.stats()
    assert (stats.bytes, stats.blocks, stats.evictions) == (BLOCK, 1, 1)
    assert RunningBatch(model, cache).join(b, cfg)[0].cached == 4
    assert RunningBatch(model, cache).join(a, cfg)[0].cached == 0


def test_a_chunk_cached_already_is_not_kept_twice():
    """A prompt pass keeps only the chunks the cache lacks: the same prompt again (its last chunk whole, so not
    reused but cached), or with its prompt logits (nothing reused), holds the same blocks and bytes."""
    model = trained_like().model
    cache = PrefixCache(2 ** 20, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=1)
    prompt = list(range(1, 9))  # two whole chunks: the first reused, the second computed again (the last token's)
    for prompt_logits in (False, False, True):
        RunningBatch(model, cache).join(prompt, cfg, prompt_logits=prompt_logits)
        stats = cache.stats()
        assert (stats.bytes, stats.blocks, stats.evictions) == (2 * BLOCK, 2, 0)


def test_a_prompt_pass_without_logits_reuses_every_whole_chunk():
    """logits="none" (the rebuild of a slid window, whose last token is not in it) needs no token's logits: every
    whole chunk is served from the cache, up to the last token, and the row's cache holds what it holds without
    the cache."""
    model = trained_like().model
    prefix = PrefixCache(2 ** 20, chunk=CHUNK)
    tokens = list(range(1, 13))  # three whole chunks
    with torch.no_grad():
        prompt_pass(model, model.new_kv_cache(1), tokens, prefix, "none")  # keeps all three
        on, off = model.new_kv_cache(1), model.new_kv_cache(1)
        assert prompt_pass(model, on, tokens, prefix, "none") == (None, 12)
        assert prompt_pass(model, off, tokens, PrefixCache(0, chunk=CHUNK), "none") == (None, 0)
        assert int(on.pos[0]) == int(off.pos[0]) == 12
        assert torch.equal(on.k[:, :, :, :12], off.k[:, :, :, :12])
        assert torch.equal(on.v[:, :, :, :12], off.v[:, :, :, :12])
        assert prompt_pass(model, model.new_kv_cache(1), tokens, prefix, "last")[1] == 8  # its last token computed


def test_the_lm_head_runs_only_where_logits_are_kept():
    """The cost of a long prompt: the LM head (a (T, V) product) runs once for "last" (the default: the last
    chunk's last position), never for "none" and on every chunk for "all"."""
    model = trained_like().model
    calls = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: calls.append(tuple(out.shape)))
    tokens = list(range(1, 14))  # four chunks, the last of one token
    off = PrefixCache(0, chunk=CHUNK)  # chunks of CHUNK tokens, none kept
    try:
        with torch.no_grad():
            last, _ = prompt_pass(model, model.new_kv_cache(1), tokens, off)
            assert calls == [(1, 1, SHAPE["vocab_size"])]
            explicit, _ = prompt_pass(model, model.new_kv_cache(1), tokens, off, "last")
            assert torch.equal(last, explicit) and last.shape == (1, SHAPE["vocab_size"])
            calls.clear()
            assert prompt_pass(model, model.new_kv_cache(1), tokens, off, "none") == (None, 0)
            assert calls == []
            every, _ = prompt_pass(model, model.new_kv_cache(1), tokens, off, "all")
            assert len(calls) == 4 and every.shape == (13, SHAPE["vocab_size"])
            assert torch.equal(every[-1:], last)
    finally:
        hook.remove()


def test_prompt_logits_keep_their_new_chunk_under_the_cached_chunk_it_hangs_from():
    """Prompt logits reuse no block but keep the chunks computed: a new block whose parent chunk is cached but least
    recently used makes room by evicting another block, never its parent, and the budget holds; the prompt's
    chunks are then all served, the evicted leaf's parent too."""
    model = trained_like().model
    cache = PrefixCache(3 * BLOCK, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=1)
    c, d, b = [10, 11, 12, 13], [30, 31, 32, 33], list(range(20, 28))
    RunningBatch(model, cache).join(c + [1], cfg)  # c: least recently used from here on
    RunningBatch(model, cache).join(b + [1], cfg)  # two blocks more: the budget is full
    (row,) = RunningBatch(model, cache).join(c + d + [1], cfg, prompt_logits=True)  # keeps d under c: b's leaf goes
    assert torch.equal(row.prompt_logits, RunningBatch(model, PrefixCache(0, chunk=CHUNK)).prompt_logits(c + d + [1]))
    stats = cache.stats()
    assert (stats.bytes, stats.blocks, stats.evictions) == (3 * BLOCK, 3, 1)
    assert RunningBatch(model, cache).join(c + d + [2], cfg)[0].cached == 8
    assert RunningBatch(model, cache).join(b + [2], cfg)[0].cached == 4


@pytest.mark.parametrize("blocks", [1, 2, 3])
def test_a_budget_smaller_than_a_prompts_chunks_keeps_its_first_chunks_exactly_and_within_the_budget(blocks):
    """A budget of 1, 2 or 3 blocks under prompts of 2 to 5 whole chunks, some sharing first chunks, one after
    another through one batch: no error (a chain being kept never loses a block to its own later ones), the bytes
    held never past the budget, each prompt keeps its first `blocks` chunks (the older prompts' blocks evicted to make
    room), and every step's logits are those without the cache. Found as a KeyError / a budget exceeded: a block's
    eviction to make room for the next block of the same prompt took the prompt's own earlier ones."""
    model = trained_like().model
    block = 2 * SHAPE["n_layer"] * SHAPE["n_embd"] * CHUNK * 4
    cache = PrefixCache(blocks * block, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=3, temperature=0)
    prompts = [list(range(1, 10)), list(range(1, 22)), list(range(1, 5)) + list(range(30, 43)), list(range(1, 18)),
               list(range(1, 22))]
    batch, off = RunningBatch(model, cache), RunningBatch(model, PrefixCache(0, chunk=CHUNK))
    for i, prompt in enumerate(prompts):
        (on_row,) = run(model, batch, [(prompt, cfg, 1)])
        (off_row,) = run(model, off, [(prompt, cfg, 1)])
        assert on_row[1] == off_row[1] and all(torch.equal(a, b) for a, b in zip(on_row[0], off_row[0])), i
        stats = cache.stats()
        assert stats.bytes <= stats.budget_bytes and stats.blocks == min(blocks, len(prompt) // CHUNK), i
    # the last prompt (21 tokens: 5 whole chunks) kept its first `blocks` chunks; the same prompt again reuses them
    assert run(model, batch, [(prompts[-1], cfg, 1)])[0][2] == CHUNK * blocks


def test_a_prompt_stopped_by_the_budget_still_marks_its_kept_chain_used_leaf_first():
    """A budget of 4 blocks: a prompt of 3 chunks, then one sharing its first chunk and 5 chunks long, whose chain
    stops at 4 blocks; an unrelated chunk then evicts one block: the chain's leaf (least recently used, as the kept
    chain was marked used leaf first), not its first block, so the long prompt again reuses its first 3 chunks."""
    model = trained_like().model
    block = 2 * SHAPE["n_layer"] * SHAPE["n_embd"] * CHUNK * 4
    cache = PrefixCache(4 * block, chunk=CHUNK)
    cfg = SampleConfig(max_new_tokens=1)
    a = list(range(1, 14))  # 3 whole chunks before its last token
    c = a[:4] + list(range(30, 47))  # a's first chunk, then 4 of its own: 21 tokens, 5 whole chunks
    for prompt in (a, c, [60, 61, 62, 63, 64]):
        RunningBatch(model, cache).join(prompt, cfg)
        assert cache.stats().bytes <= 4 * block
    assert RunningBatch(model, cache).join(c, cfg)[0].cached == 3 * CHUNK
