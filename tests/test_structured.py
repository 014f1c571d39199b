"""Constrained generation (gptlab.inference.grammar, the engine's rows): every output of 81 JSON schemas, on a char
model and on GPT-2's BPE, greedy and sampled, untrained, parses and validates with the `jsonschema` library; every
token is one llguidance's own check allows at its step; a grammar's forced run fed in one step gives what one
token a step gives; logit_bias, penalties, top-k and top-p obey the mask; rows with and without a grammar share a
batch; bad schemas, missing characters and dead ends are refused in one line."""

import json
from pathlib import Path

import jsonschema
import llguidance
import pytest
import torch
from helpers import trained_like

from gptlab.config import SampleConfig
from gptlab.engine import RunningBatch, generate_batch, generate_uncached, one_thread
from gptlab.errors import GptlabError
from gptlab.inference.grammar import DeadEnd, GrammarError, compile_grammar, lltokenizer
from gptlab.inference.loading import prepare_for_inference
from gptlab.inference.rows import Steer
from gptlab.sampling import next_token
from gptlab.tokenizer import CharTokenizer, GPT2Tokenizer

SCHEMAS = json.loads((Path(__file__).parent / "data" / "schemas.json").read_text())
PRINTABLE = [chr(c) for c in range(32, 127)]
BUDGET = 200  # tokens a schema's output gets


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def gpt2():
    return GPT2Tokenizer()


@pytest.fixture(scope="module")
def chars():
    return CharTokenizer(PRINTABLE + ["\n"])


def untrained(tokenizer, seed=0, block_size=256):
    torch.manual_seed(seed)
    return trained_like(dict(n_layer=2, n_head=2, n_embd=32, vocab_size=tokenizer.vocab_size, block_size=block_size,
                             dropout=0.0), seed=seed)


def outputs(model, tokenizer, prompt, cfg, steer, width=1):
    """Each row's ids (None-free) of `prompt` decoded `width` samples at once, and whether it ended normally (its
    grammar complete) before the budget."""
    rows = list(zip(*generate_batch(model, [tokenizer.encode(prompt)], cfg, width, steer=steer)))
    out = []
    for r in range(width):
        ids = [i for i in rows[r] if i is not None] if rows else []
        out.append((ids, bool(rows) and rows[r][-1] is None or len(ids) < cfg.max_new_tokens))
    return out


def check_tokens(grammar, ids):
    """llguidance's own check, token by token, on a fresh matcher: each token allowed where it came."""
    matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
    for n, token in enumerate(ids):
        assert matcher.validate_tokens([token]) == 1, f"token {n} ({token}) refused by llguidance"
        assert matcher.consume_token(token)
    return matcher


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_eighty_one_schemas_give_json_that_validates_greedy_and_sampled_on_an_untrained_model(kind, gpt2, chars):
    """The acceptance set: 81 schemas x greedy and sampled on an untrained model (its free output is noise): every
    output that stops normally parses and validates with jsonschema, every token passes llguidance's check step by
    step, and >= 99 % of those whose length the schema bounds stop normally within the budget (the truncated ones
    counted and named; a JSON number's fraction is not bounded: those truncated are counted apart)."""
    tokenizer = chars if kind == "char" else gpt2
    model = prepare_for_inference(untrained(tokenizer), "fp32")
    finished, truncated, unbounded = 0, [], 0
    for n, schema in enumerate(SCHEMAS):
        grammar = compile_grammar("json_schema", schema, tokenizer)
        for cfg in (SampleConfig(max_new_tokens=BUDGET, temperature=0),
                    SampleConfig(max_new_tokens=BUDGET, temperature=1.0, top_p=0.95, seed=n)):
            ((ids, ended),) = outputs(model, tokenizer, "Answer: ", cfg, Steer(grammar=grammar))
            matcher = check_tokens(grammar, ids)
            if not ended and '"number"' in json.dumps(schema):  # a JSON number's fraction has no length limit
                unbounded += 1
                continue
            if not ended:
                truncated.append(schema["title"])
                continue
            assert matcher.is_accepting(), schema["title"]
            jsonschema.validate(json.loads(tokenizer.decode(ids)), schema)
            finished += 1
    total = 2 * len(SCHEMAS) - unbounded
    print(f"{kind}: {finished} of {total} bounded outputs stopped normally; truncated: {truncated}; numbers "
          f"unbounded in length truncated: {unbounded}")
    assert finished >= 0.99 * total, f"truncated at {BUDGET} tokens: {truncated}"
    assert len(SCHEMAS) >= 50 and unbounded <= 6


@pytest.mark.device_path("fused decode (native)")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_forced_run_in_one_step_gives_what_one_token_a_step_gives(fused_kernel, precision, gpt2):
    """Long fixed keys force runs of several tokens: fed to the fused step in one verify, every token and the logits
    it came from are bit for bit those of one token a step, greedy and seeded, alone and beside other rows."""
    from gptlab.runtime import bf16_supported

    if precision == "bf16" and not bf16_supported(torch.device("cpu")):
        pytest.skip("no native bf16 on this CPU")
    schema = {"type": "object", "properties": {
        "the_first_very_long_property_name": {"type": "integer", "minimum": 0, "maximum": 99},
        "another_quite_long_property_name_here": {"enum": ["alpha_value", "beta_value"]},
        "short": {"type": "string", "maxLength": 6}}, "additionalProperties": False,
        "required": ["the_first_very_long_property_name", "another_quite_long_property_name_here", "short"]}
    grammar = compile_grammar("json_schema", schema, gpt2)
    model = prepare_for_inference(untrained(gpt2, 1), precision)
    assert model.fused
    for cfg in (SampleConfig(max_new_tokens=80, temperature=0), SampleConfig(max_new_tokens=80, temperature=0.8,
                                                                              top_k=50, seed=5)):
        got = {}
        for one_step in (True, False):
            batch = RunningBatch(model)
            batch.forced_in_one_step = one_step
            rows = [row for p in ("a", "b c", "d e f") for row in batch.join(gpt2.encode(p), cfg, 2,
                                                                              steer=Steer(grammar=grammar))]
            rows.append(batch.join(gpt2.encode("free"), cfg)[0])  # a row with no grammar beside them
            seen, steps = {row: [] for row in rows}, 0
            while batch.rows:
                for row, token, logits in batch.sample():
                    seen[row].append((token, logits.clone()))
                batch.advance()
                steps += any(row in batch.rows for row in rows[:-1])  # steps until the constrained rows end
            got[one_step] = ([seen[row] for row in rows], steps)
        (fast, fast_steps), (slow, slow_steps) = got[True], got[False]
        for a, b in zip(fast, slow):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
        assert fast_steps < slow_steps  # the forced runs took fewer steps
        for ids in fast[:-1]:
            jsonschema.validate(json.loads(gpt2.decode([t for t, _ in ids])), schema)


def test_the_torch_step_and_the_uncached_reference_give_the_same_constrained_output(chars):
    """The plain model (the torch step: forced tokens one a step) and generate_uncached (no cache) agree, greedy, on
    a regex and a Lark grammar; both end where the grammar is complete (None for a row that ended before another)."""
    model = untrained(chars, 2)
    for kind, source in (("regex", "[a-c]{2,4}-[0-9]{1,3}!"),
                         ("lark", 'start: "(" item ("," item)? ")"\nitem: /[xyz]{1,3}/ | "nil"')):
        grammar = compile_grammar(kind, source, chars)
        cfg = SampleConfig(max_new_tokens=40, temperature=0)
        prompts = [chars.encode("go: "), chars.encode("x")]
        a = list(generate_batch(model, prompts, cfg, steer=Steer(grammar=grammar)))
        b = list(generate_uncached(model, prompts, cfg, steer=Steer(grammar=grammar)))
        assert a == b and len(a) < 40  # both ended where the grammar was complete, before the budget
        for row in zip(*a):
            text = chars.decode([i for i in row if i is not None])
            assert check_tokens(grammar, chars.encode(text)).is_accepting(), text


def test_sampling_settings_and_logit_bias_obey_the_mask():
    """next_token with a mask: greedy takes the likeliest allowed token; temperature, top-k, top-p and penalties
    never draw a refused one (2,000 draws each); logit_bias is added before the mask (a +100 on a refused token
    does not let it through) and before the penalties."""
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    allowed = torch.tensor([False, True, False, True, True, False])
    assert int(next_token(logits, SampleConfig(temperature=0), allowed=allowed)) == 1
    assert int(next_token(logits, SampleConfig(temperature=0), bias={0: 100.0}, allowed=allowed)) == 1
    assert int(next_token(logits, SampleConfig(temperature=0), bias={4: 100.0}, allowed=allowed)) == 4
    assert int(next_token(logits, SampleConfig(temperature=0), bias={1: -100.0}, allowed=allowed)) == 3
    counts = torch.tensor([[0, 3, 0, 0, 0, 0]])
    cfg = SampleConfig(temperature=0, frequency_penalty=1.0)  # 4 - 3 = 1 < 2: token 3 wins
    assert int(next_token(logits, cfg, counts=counts, allowed=allowed)) == 3
    generator = torch.Generator().manual_seed(0)
    for cfg in (SampleConfig(temperature=2.0), SampleConfig(temperature=1.0, top_k=2),
                SampleConfig(temperature=1.0, top_p=0.5), SampleConfig(temperature=1.5, presence_penalty=2.0)):
        drawn = {int(next_token(logits, cfg, generator, counts=counts, allowed=allowed)) for _ in range(2000)}
        assert drawn <= {1, 3, 4} and len(drawn) >= 1
    # top-k 2 over the allowed tokens: 1 and 3 (4 is third)
    drawn = {int(next_token(logits, SampleConfig(temperature=1.0, top_k=2), generator, allowed=allowed))
             for _ in range(500)}
    assert drawn == {1, 3}


def test_logit_bias_bans_and_forces_against_the_unbiased_logits(chars):
    """-100 on the unbiased greedy choice: the next best; +100 on any token: that token, every step; the logits the
    row reports are the model's own (unbiased)."""
    model = prepare_for_inference(untrained(chars, 3), "fp32")
    prompt = chars.encode("abc")
    cfg = SampleConfig(max_new_tokens=6, temperature=0)
    free = [row[0] for row in generate_batch(model, [prompt], cfg)]
    batch = RunningBatch(model)
    (row,) = batch.join(prompt, SampleConfig(max_new_tokens=1, temperature=0), steer=Steer(logit_bias={free[0]: -100}))
    ((_, token, logits),) = batch.sample()
    assert token == int(logits[0].topk(2).indices[1]) and token != free[0]
    forced = chars.encode("Q")[0]
    got = [row[0] for row in generate_batch(model, [prompt], cfg, steer=Steer(logit_bias={forced: 100}))]
    assert got == [forced] * 6


def test_rows_with_and_without_a_grammar_share_a_batch_and_the_free_row_is_unchanged(chars):
    model = prepare_for_inference(untrained(chars, 4), "fp32")
    grammar = compile_grammar("regex", "[0-9]{3}", chars)
    cfg = SampleConfig(max_new_tokens=12, temperature=0.9, seed=11)
    alone = [r[0] for r in generate_batch(model, [chars.encode("hello")], cfg)]
    batch = RunningBatch(model)
    (constrained,) = batch.join(chars.encode("n: "), cfg, steer=Steer(grammar=grammar))
    (free,) = batch.join(chars.encode("hello"), cfg)
    got = {constrained: [], free: []}
    while batch.rows:
        for row, token, _ in batch.sample():
            got[row].append(token)
        batch.advance()
    assert got[free] == alone
    assert len(got[constrained]) == 3 and chars.decode(got[constrained]).isdigit() and constrained.finish == "stop"


def test_without_fast_forward_every_token_is_drawn_under_the_mask_and_still_valid(gpt2):
    """fast_forward off (what the bench compares against): no forced run is taken, the model draws each token
    under the mask (its own tokenization of the keys), and the output still validates."""
    schema = {"type": "object", "properties": {"temperature_in_celsius": {"type": "integer", "minimum": -50,
                                                                          "maximum": 60}},
              "required": ["temperature_in_celsius"], "additionalProperties": False}
    grammar = compile_grammar("json_schema", schema, gpt2)
    model = prepare_for_inference(untrained(gpt2, 5), "fp32")
    for ff in (True, False):
        ((ids, ended),) = outputs(model, gpt2, "x", SampleConfig(max_new_tokens=60, temperature=0),
                                  Steer(grammar=grammar, fast_forward=ff))
        assert ended
        jsonschema.validate(json.loads(gpt2.decode(ids)), schema)
    constraint = grammar.start(fast_forward=False)
    assert not constraint.queue and grammar.start().queue  # the run starts forced: {"temperature...


def test_a_bad_grammar_is_refused_with_llguidances_own_words_on_one_line(chars):
    text = llguidance.LLMatcher.grammar_from_regex("x[0-9")
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, lltokenizer(chars))
    assert failed and "\n" in messages[0]  # llguidance's message spans lines
    with pytest.raises(GrammarError) as got:
        compile_grammar("regex", "x[0-9", chars)
    assert str(got.value) == "the regex is not valid: " + " ".join(messages[0].split())


def test_bad_schemas_and_grammars_are_refused_in_one_line_naming_what_is_wrong(chars):
    for kind, source, words in (("json_schema", {"type": "bogus"}, "JSON schema is not valid"),
                                ("json_schema", "{not json", "not JSON"),
                                ("json_schema", [1, 2], "must be a JSON object"),
                                ("regex", "x[0-9", "regex is not valid"),
                                ("regex", "", "must be a non-empty string"),
                                ("lark", "start: undefined_rule", "Lark grammar is not valid"),
                                ("yaml", "x", "kind must be one of")):
        with pytest.raises(GrammarError) as got:
            compile_grammar(kind, source, chars)
        assert words in str(got.value) and "\n" not in str(got.value), str(got.value)


def test_a_schema_whose_characters_the_vocabulary_lacks_is_refused_naming_them():
    """A char model trained on text without braces or digits: json_object needs { and }, an integer needs a digit,
    a required key its letters, a regex its forced characters; an enum with one writable option is fine."""
    letters = CharTokenizer(list("abcdefghij \":,"))
    cases = [("json_object", None, ['"{"', '"}"']),
             ("json_schema", {"type": "integer", "minimum": 0, "maximum": 9}, ["a digit"]),
             ("json_schema", {"type": "object", "properties": {"xyz": {"type": "string"}}, "required": ["xyz"]},
              ['"x"', '"y"', '"z"', '"{"', '"}"']),
             ("regex", "QR[a-c]", ['"Q"', '"R"'])]
    for kind, source, named in cases:
        with pytest.raises(GrammarError) as got:
            compile_grammar(kind, source, letters)
        assert "vocabulary lacks" in str(got.value) and all(n in str(got.value) for n in named), str(got.value)
    compile_grammar("json_schema", {"enum": ["zzz", "abc"]}, letters)  # "abc" is writable


def test_a_row_whose_mask_becomes_empty_later_ends_with_a_clear_error():
    """A grammar whose first characters the vocabulary has but whose later ones it lacks: the row gets there and
    generation fails with DeadEnd (a GptlabError) naming what it needed."""
    tokenizer = CharTokenizer(list("ab"))
    grammar = compile_grammar("regex", "ab(a|b)Z", tokenizer)
    model = prepare_for_inference(untrained(tokenizer, 6, block_size=32), "fp32")
    with pytest.raises(DeadEnd) as got:
        list(generate_batch(model, [[0]], SampleConfig(max_new_tokens=10, temperature=0), steer=Steer(grammar=grammar)))
    assert str(got.value) == ("the constraint allows no token this model has next (it needs 'Z'); use a model "
                              "whose vocabulary writes it")
    assert isinstance(got.value, GptlabError)
    choice = compile_grammar("regex", "ab(c|d)", tokenizer)  # nothing forced where it ends: no text to name
    with pytest.raises(DeadEnd) as got:
        list(generate_batch(model, [[0]], SampleConfig(max_new_tokens=10, temperature=0), steer=Steer(grammar=choice)))
    assert str(got.value) == ("the constraint allows no token this model has next; use a model whose vocabulary "
                              "writes it")
    accents = compile_grammar("regex", "ab(é|è)", tokenizer)  # forced: the first byte of either, half a character
    with pytest.raises(DeadEnd) as got:
        list(generate_batch(model, [[0]], SampleConfig(max_new_tokens=10, temperature=0), steer=Steer(grammar=accents)))
    assert str(got.value) == ("the constraint allows no token this model has next (it needs '\ufffd'); use a model "
                              "whose vocabulary writes it")


def test_a_token_the_grammar_refuses_ends_the_constraint_with_llguidances_reason(chars):
    """A caller that consumes a token the mask refuses: DeadEnd naming the token and llguidance's reason; the
    constraint stays failed, and says so with the same reason when asked for its mask."""
    constraint = compile_grammar("regex", "[0-9]+", chars).start()
    bad = chars.encode("x")[0]
    with pytest.raises(DeadEnd) as refused:
        constraint.consume(bad)
    reason = " ".join(constraint.matcher.get_error().split())
    assert reason and str(refused.value) == f"the constraint refused token {bad}: {reason}"
    with pytest.raises(DeadEnd) as failed:
        constraint.allowed()
    assert str(failed.value) == f"the constraint failed: {reason}"


def test_a_token_the_mask_forces_is_taken_without_a_draw(chars):
    """fast_forward off, sampled: where the mask allows one token (the Q of (x|y)Q(x|y)) the row takes it without
    using a random number, so its generator has drawn once per free choice: twice."""
    grammar = compile_grammar("regex", "(x|y)Q(x|y)", chars)
    model = prepare_for_inference(untrained(chars, 9), "fp32")
    batch = RunningBatch(model)
    (row,) = batch.join(chars.encode("go"), SampleConfig(max_new_tokens=10, temperature=1.0, seed=5),
                        steer=Steer(grammar=grammar, fast_forward=False))
    tokens = []
    while batch.rows:
        tokens += [t for _, t, _ in batch.sample()]
        batch.advance()
    assert chars.decode(tokens)[1] == "Q" and len(tokens) == 3
    twice = torch.Generator().manual_seed(5)
    for _ in range(2):
        torch.rand(1, 1, generator=twice)
    assert torch.equal(row.sampler.generator.get_state(), twice.get_state())


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_mask_is_ready_after_a_step_where_it_is_computed_while_the_model_runs(overlap, chars, monkeypatch):
    import gptlab.engine as engine

    monkeypatch.setattr(engine, "OVERLAP_MASKS", overlap)
    model = prepare_for_inference(untrained(chars, 10), "fp32")
    batch = RunningBatch(model)
    (row,) = batch.join(chars.encode("go"), SampleConfig(max_new_tokens=6, temperature=0),
                        steer=Steer(grammar=compile_grammar("regex", "[a-z]{6}", chars), fast_forward=False))
    batch.sample()
    assert not row.sampler.constraint.mask_ready  # the token drawn moved it on
    batch.advance()
    assert row.sampler.constraint.mask_ready is overlap and len(batch.mask_waits) == (1 if overlap else 0)


def test_the_char_vocabulary_gets_an_end_id_past_its_ids_and_bpe_keeps_its_own(chars, gpt2):
    assert lltokenizer(chars).eos_token == chars.vocab_size and lltokenizer(gpt2).eos_token == gpt2.eot_id
    assert lltokenizer(gpt2) is lltokenizer(gpt2)  # made once per tokenizer


@pytest.mark.parametrize("precision", ["fp32"])
def test_masks_computed_while_the_model_runs_or_between_steps_give_the_same_output(precision, gpt2, monkeypatch):
    """The engine's worker thread (OVERLAP_MASKS, the default) against masks computed between steps: the same tokens,
    greedy and seeded, in a batch of constrained and free rows; a dead end found on the worker is raised the same."""
    import gptlab.engine as engine

    grammar = compile_grammar("json_schema", SCHEMAS[0], gpt2)
    model = prepare_for_inference(untrained(gpt2, 7), precision)
    got = {}
    for overlap in (True, False):
        monkeypatch.setattr(engine, "OVERLAP_MASKS", overlap)
        for cfg in (SampleConfig(max_new_tokens=50, temperature=0), SampleConfig(max_new_tokens=50, temperature=1.0,
                                                                                  seed=9)):
            rows = list(generate_batch(model, [gpt2.encode("a"), gpt2.encode("b c")], cfg, 2,
                                       steer=Steer(grammar=grammar)))
            got.setdefault(overlap, []).append(rows)
        tokenizer = CharTokenizer(list("ab"))
        late = compile_grammar("regex", "ab(a|b)Z", tokenizer)
        with pytest.raises(DeadEnd, match="'Z'"):
            list(generate_batch(prepare_for_inference(untrained(tokenizer, 6, block_size=32), precision), [[0]],
                                SampleConfig(max_new_tokens=10, temperature=0), steer=Steer(grammar=late)))
    assert got[True] == got[False]


def test_the_vocabulary_as_llguidance_reads_it(chars, gpt2):
    """Special tokens are no text: end-of-text and a chat run's markers are llguidance's special (end) tokens, so no
    JSON string may hold them; a char vocabulary's end is one past its ids; forced text with a character the
    vocabulary lacks is written with the characters it has (llguidance asks gptlab's encoder)."""
    from gptlab.tokenizer import ChatTokenizer

    small = CharTokenizer(list("ab "))
    lt = lltokenizer(small)
    assert lt.tokenize_str("a{b") == small.encode("ab") and lt.tokenize_str("ab a") == small.encode("ab a")
    assert lt.is_special_token(3) and lt.eos_tokens == [3] and not lt.is_special_token(0)
    big = lltokenizer(gpt2)
    assert big.is_special_token(gpt2.eot_id) and not any(big.is_special_token(i) for i in (0, 100, 50255))
    assert big.decode_bytes([gpt2.eot_id]) == b"<|endoftext|>" and big.eos_tokens == [gpt2.eot_id]
    string = compile_grammar("json_schema", {"type": "string", "maxLength": 5}, gpt2).start()
    string.consume(gpt2.encode('"')[0])
    allowed = string.allowed()
    assert not allowed[gpt2.eot_id] and allowed[gpt2.encode("a")[0]]  # inside a string: text, not the end
    chat = ChatTokenizer(CharTokenizer(list('ab {}":')))
    lc = lltokenizer(chat)
    markers = sorted(chat.special_ids.values())
    assert [i for i in range(chat.vocab_size) if lc.is_special_token(i)] == markers and lc.eos_tokens == markers
    assert lc.tokenize_str('{"a"}') == chat.encode('{"a"}')


@pytest.mark.device_path("fused decode (native)")
def test_speculation_under_a_grammar_proposes_only_what_the_grammar_allows_and_changes_nothing(fused_kernel, chars):
    """speculate auto on constrained rows: each proposal the lookup makes is cut where the grammar would refuse it
    (every proposal checked is one llguidance accepts after the row's tokens), proposals are made and kept, and the
    tokens and logits are those without speculation."""
    grammar = compile_grammar("regex", "(ab|ba|abc){3,40}", chars)
    model = prepare_for_inference(untrained(chars, 8), "fp32")
    prompt = chars.encode("abcabcabcabc abab")
    got, proposed = {}, 0
    for mode in ("off", "auto"):
        batch = RunningBatch(model)
        (row,) = batch.join(prompt, SampleConfig(max_new_tokens=60, temperature=0, speculate=mode),
                            steer=Steer(grammar=grammar))
        seen = []
        while batch.rows:
            seen += [(token, logits.clone()) for _, token, logits in batch.sample()]
            batch.advance()
            if row.drafts and not row.forced_run:
                tokens = [t for t, _ in seen]
                check = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
                assert check.consume_tokens(tokens) and check.validate_tokens(row.drafts) == len(row.drafts)
                proposed += len(row.drafts)
        got[mode] = seen
    assert [t for t, _ in got["off"]] == [t for t, _ in got["auto"]]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got["off"], got["auto"]))
    assert proposed > 0


def after_a_free_value(schema, required=("a", "b")):
    """`schema` as property b, after a free string a: nothing forces its characters at the start."""
    return {"type": "object", "properties": {"a": {"type": "string"}, "b": schema}, "required": list(required),
            "additionalProperties": False}


@pytest.mark.parametrize("schema, named", [
    (after_a_free_value({"type": "array", "items": {"const": "QQ"}, "minItems": 1, "maxItems": 3}), ['"Q"']),
    (after_a_free_value({"type": "array", "items": {"type": "integer"}, "minItems": 1}), ["a digit"]),
    (after_a_free_value({"type": "number", "minimum": 0, "maximum": 1}), ["a digit"]),
    (after_a_free_value({"type": "boolean"}), ['"l"', '"s"']),
    (after_a_free_value({"type": "null"}), ['"n"', '"u"', '"l"']),
    (after_a_free_value({"const": "QQ"}, required=["b"]), ['"Q"']),
])
def test_what_comes_after_a_free_value_is_checked_too(schema, named):
    """The same checks where no forced text reaches them (the first value is free): the schema alone tells."""
    letters = CharTokenizer(list('abcdefghijk{}[]":,é '))
    with pytest.raises(GrammarError) as got:
        compile_grammar("json_schema", schema, letters)
    assert all(n in str(got.value) for n in named), str(got.value)


@pytest.mark.parametrize("schema", [
    after_a_free_value({"type": "array", "items": {"type": "integer"}, "maxItems": 2}),  # [] needs no digit
    after_a_free_value({"type": "array", "items": {"const": "a"}, "minItems": 2, "maxItems": 2}),  # ["a","a"]
    after_a_free_value({"type": "object", "properties": {"q": {"type": "integer"}}}),  # {} writable
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}, "required": ["a"]},
])
def test_what_comes_after_a_free_value_and_can_be_written_is_accepted(schema):
    compile_grammar("json_schema", schema, CharTokenizer(list('abcdefghijk{}[]":,é ')))


def test_a_comma_between_two_required_values_is_named_where_the_vocabulary_lacks_it():
    no_comma = CharTokenizer(list('abcdefghijk{}[]":é '))
    with pytest.raises(GrammarError, match='","'):
        compile_grammar("json_schema", after_a_free_value({"type": "string"}), no_comma)
    with pytest.raises(GrammarError, match='","'):  # two items, after a free value
        compile_grammar("json_schema", after_a_free_value({"type": "array", "items": {"type": "string"},
                                                            "minItems": 2}, required=["b"]), no_comma)
    compile_grammar("json_schema", after_a_free_value({"type": "array", "items": {"type": "string"}, "minItems": 1},
                                                      required=["b"]), no_comma)  # one item: no comma
    with pytest.raises(GrammarError, match="its first character"):  # nothing forced, nothing writable first
        compile_grammar("regex", "(Q|R)a", no_comma)


@pytest.mark.parametrize("schema, named", [
    ({"enum": ["XYZ", "QQ"]}, ['"Q"']),  # no option writable: the one lacking fewest, named
    ({"const": "QR"}, ['"Q"', '"R"']),
    ({"anyOf": [{"const": "QQ"}, {"const": "RRR"}]}, ['"Q"']),  # no branch writable: the fewest lacked
    ({"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"const": "RRR"}]}, ["a digit"]),  # ties: the first
    ({"type": ["integer", "null"], "minimum": 0, "maximum": 9}, ["a digit"]),  # "null" lacks "n", "u", "l": 3
    ({"type": "boolean"}, ['"l"', '"s"']),  # false lacks fewer than true (t, r, u)
    ({"type": "null"}, ['"n"', '"u"', '"l"']),
    ({"type": "array", "items": {"const": "QQ"}, "minItems": 2, "maxItems": 3}, ['"Q"', '","']),
    ({"type": "object", "properties": {"k": {"type": "object", "properties": {"zz": {"type": "string"}},
                                              "required": ["zz"]}}, "required": ["k"]}, ['"z"']),
    ({"type": "object", "properties": {"a": {"const": 1}, "b": {"const": 2}}, "required": ["a", "b"]}, ['","']),
    # a required key, and a required value, that only come after a free value (nothing forces them at the start)
    ({"type": "object", "properties": {"a": {"type": "string"}, "zz": {"type": "string"}}, "required": ["a", "zz"],
      "additionalProperties": False}, ['"z"']),
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"const": "QQ"}}, "required": ["a", "b"],
      "additionalProperties": False}, ['"Q"']),
])
def test_a_schema_no_instance_of_which_the_vocabulary_can_write_is_refused_naming_what_is_lacked(schema, named):
    letters = CharTokenizer(list('abcdefghijk{}[]":é '))  # no digits, no comma, no Q R X Y Z n u l t r s
    with pytest.raises(GrammarError) as got:
        compile_grammar("json_schema", schema, letters)
    message = str(got.value)
    assert "vocabulary lacks" in message and all(n in message for n in named), message
    if schema.get("enum"):
        assert '"X"' not in message  # the option that lacks more is not the one named


@pytest.mark.parametrize("schema", [
    {"enum": ["QQ", "abc"]},  # one writable option
    {"anyOf": [{"const": "QQ"}, {"type": "string"}]},  # one writable branch
    {"type": ["integer", "string"]},  # a string can be written
    {"enum": ["é"]},  # written as the character itself, not \\u00e9
    {"enum": [{"a": "b"}]},  # written compactly: no space needed after ":"
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},  # [] needs no digit
    {"type": "object", "properties": {"n": {"type": "null"}}},  # an optional key needs nothing
])
def test_a_schema_with_a_writable_instance_is_accepted(schema):
    compile_grammar("json_schema", schema, CharTokenizer(list('abcdefghijk{}[]":é')))  # no space, no comma


def test_a_model_with_unused_vocabulary_rows_never_draws_them_under_a_grammar(chars):
    """A model whose vocabulary is wider than its tokenizer's (unused rows, the widest logits there): the mask
    refuses the ids past the tokenizer's, greedy and sampled."""
    torch.manual_seed(0)
    model = trained_like(dict(n_layer=1, n_head=2, n_embd=16, vocab_size=chars.vocab_size + 7, block_size=64,
                              dropout=0.0))
    with torch.no_grad():  # the unused rows: ten times the likeliest token's row (its logit is positive here)
        logits, _ = model(torch.tensor([chars.encode("x")]))
        best = int(logits[0, -1, :chars.vocab_size].argmax())
        assert logits[0, -1, best] > 0
        model.lm_head.weight[chars.vocab_size:] = 10 * model.lm_head.weight[best]
    grammar = compile_grammar("regex", "[a-z]{5}", chars)
    for cfg in (SampleConfig(max_new_tokens=8, temperature=0), SampleConfig(max_new_tokens=8, temperature=1.0,
                                                                             seed=4)):
        free = [r[0] for r in generate_batch(model, [chars.encode("x")], cfg)]
        assert max(free) >= chars.vocab_size  # unconstrained, the unused rows win
        ids = [r[0] for r in generate_batch(model, [chars.encode("x")], cfg, steer=Steer(grammar=grammar))]
        ids = [i for i in ids if i is not None]
        assert len(ids) == 5 and chars.decode(ids).isalpha()


def test_where_only_an_end_token_is_left_but_the_grammar_is_not_complete_it_is_a_dead_end_not_an_end():
    """llguidance allows the end tokens where nothing can follow, so that generation stops: for a vocabulary with end
    tokens (a chat run's markers) that is a dead end, not a complete output: refused at the start, an error later;
    where the grammar is complete or may end, the end tokens are allowed as they are."""
    from gptlab.tokenizer import ChatTokenizer

    chat = ChatTokenizer(CharTokenizer(list("ab")))
    with pytest.raises(GrammarError, match="its first character"):
        compile_grammar("regex", "(Q|R)a", chat)
    model = prepare_for_inference(untrained(chat, 11, block_size=32), "fp32")
    later = compile_grammar("regex", "ab(é|è)", chat)
    with pytest.raises(DeadEnd, match="allows no token this model has next"):
        list(generate_batch(model, [[0]], SampleConfig(max_new_tokens=10, temperature=0), steer=Steer(grammar=later)))
    may_end = compile_grammar("regex", "a(b)?", chat).start()
    may_end.consume(chat.encode("a")[0])
    allowed = may_end.allowed()
    assert allowed[chat.encode("b")[0]] and all(allowed[i] for i in chat.special_ids.values())
