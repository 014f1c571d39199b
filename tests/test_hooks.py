"""Hook points by TransformerLens's names, held to TransformerLens itself: every hook tensor and the logits of a
`HookedTransformer` built offline from the same weights (through transformers' GPT-2 and TransformerLens's own
converter, no weight processing), on a random GPT with odd sizes moved off its init and on a transformers GPT-2
imported; hooks that replace an activation; the cache during generation against a recompute; the errors."""

import sys
import warnings

import pytest
import torch
from helpers import HF_SHAPES, hf_folder, one_torch_thread, perturbed, tiny_config  # noqa: F401  (autouse fixture)

from gptlab.errors import GptlabError
from gptlab.hf.gpt2_folders import load_hf_model, to_hf_tensors
from gptlab.inspect.hooks import Hooked, HookError, hook_names
from gptlab.inspect.lens import hooked_transformer
from gptlab.model import GPT, Bigram

tl = pytest.importorskip("transformer_lens", reason="pip install -e '.[test]' (transformer-lens 3.9)")
from transformer_lens import HookedTransformer, HookedTransformerConfig  # noqa: E402
from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights  # noqa: E402

TOL = 1e-5  # relative to the tensor's largest finite |value|
ODD = dict(n_layer=3, n_head=3, n_embd=15, block_size=19, vocab_size=23, bias=True, dropout=0.0,
           layer_norm_eps=1e-4, activation="gelu")


def lens_of(model: GPT) -> HookedTransformer:
    """TransformerLens's model of the same weights, built the way it builds GPT-2: transformers' GPT2LMHeadModel
    from the weights, then TransformerLens's own converter (none of gptlab's inspect code involved)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    act = "gelu_new" if c.activation == "gelu_tanh" else "gelu"
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd,
                                    n_layer=c.n_layer, n_head=c.n_head, activation_function=act,
                                    layer_norm_epsilon=c.layer_norm_eps))
    missing, unexpected = hf.load_state_dict(to_hf_tensors(model, c.vocab_size), strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.block_size, d_head=c.head_dim,
                                  n_heads=c.n_head, d_vocab=c.vocab_size, act_fn=act, normalization_type="LN",
                                  eps=c.layer_norm_eps, d_mlp=4 * c.n_embd, default_prepend_bos=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        lens = HookedTransformer(cfg)
    lens.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                     center_unembed=False, fold_value_biases=False,
                                     refactor_factored_attn_matrices=False)
    return lens.eval()


def worst(a: torch.Tensor, b: torch.Tensor, name: str = "") -> float:
    """Largest |a - b| over finite entries relative to a's largest finite |value|; -inf in the same places."""
    a, b = a.detach(), b.detach()
    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b)), f"{name}: -inf in different places"
    if not finite.any():
        return 0.0
    return float((a[finite] - b[finite]).abs().max() / a[finite].abs().max().clamp_min(1e-30))



@pytest.fixture(scope="module")
def odd():
    torch.manual_seed(0)
    return perturbed(GPT(tiny_config(**ODD))).eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    folder = hf_folder(tmp_path_factory.mktemp("hf"), seed=3, **HF_SHAPES["3-heads-context-40-exact-gelu"])
    return perturbed(load_hf_model(folder))  # its biases and LayerNorms moved off transformers' init too


def parity_rows(model: GPT, ids: torch.Tensor) -> list[tuple[str, float]]:
    """(hook name, worst relative difference against TransformerLens) for every hook point, then the logits."""
    lens = lens_of(model)
    theirs, their_cache = lens.run_with_cache(ids)
    ours, cache = Hooked(model).run_with_cache(ids)
    rows = [(name, worst(their_cache[name], cache[name], name)) for name in hook_names(model.config.n_layer)]
    for name in cache:
        assert cache[name].shape == their_cache[name].shape, name
    return [*rows, ("logits", worst(theirs, ours))]


@pytest.mark.parametrize("which", ["odd sizes, off init", "transformers GPT-2, imported", "no biases, tanh GELU"])
def test_every_hook_tensor_and_the_logits_match_transformer_lens(odd, imported, which):
    model = {"odd": odd, "transformers": imported}.get(which.split()[0]) or perturbed(GPT(tiny_config(
        **{**ODD, "bias": False, "activation": "gelu_tanh", "n_head": 5}))).eval()  # LayerNorms without a bias
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5))
    rows = parity_rows(model, ids)
    print(f"\n{which}: {'hook':<36} worst difference (relative)")
    for name, diff in rows:
        print(f"  {name:<36} {diff:.2e}")
    assert len(rows) == 2 + 17 * model.config.n_layer + 2 + 1
    assert all(diff <= TOL for _, diff in rows), [r for r in rows if r[1] > TOL]


def test_the_hook_points_are_transformer_lens_s_names_and_shapes(odd):
    _, their_cache = lens_of(odd).run_with_cache(torch.tensor([[1, 2]]))  # the points its GPT-2 runs through
    assert hook_names(3) == [n for n in their_cache if not n.startswith("unembed.")]
    _, cache = Hooked(odd).run_with_cache(torch.tensor([[1, 2, 3, 4, 5]]))
    assert list(cache) == hook_names(3)  # the order the forward reaches them
    assert cache["blocks.1.attn.hook_q"].shape == (1, 5, 3, 5)  # (batch, pos, head, d_head)
    assert cache["blocks.1.attn.hook_pattern"].shape == (1, 3, 5, 5)  # (batch, head, query, key)
    assert cache["ln_final.hook_scale"].shape == (1, 5, 1)
    scores = cache["blocks.0.attn.hook_attn_scores"][0, 0]
    assert torch.isinf(scores.triu(1)[scores.triu(1) != 0]).all() and torch.isfinite(scores.tril()).all()


def test_the_newer_names_and_the_short_keys_read_the_same_tensors(odd):
    _, cache = Hooked(odd).run_with_cache(torch.tensor([[3, 1, 4, 1, 5]]))
    assert cache["blocks.2.hook_in"] is cache["blocks.2.hook_resid_pre"]
    assert cache["blocks.0.hook_out"] is cache["blocks.0.hook_resid_post"]
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["resid_pre", 0] is cache["blocks.0.hook_resid_pre"]
    assert cache["scale"] is cache["ln_final.hook_scale"] and cache["embed"] is cache["hook_embed"]
    assert "blocks.1.hook_in" in cache and "blocks.9.hook_in" not in cache
    with pytest.raises(KeyError, match="not one"):
        cache["scale", 7]
    _, only = Hooked(odd).run_with_cache(torch.tensor([[3, 1]]), names_filter="blocks.1.hook_in")
    assert list(only) == ["blocks.1.hook_resid_pre"]


@pytest.mark.parametrize("names", ["blocks.1.attn.hook_z", ["hook_embed", "blocks.0.mlp.hook_post"],
                                   lambda name: name.endswith("hook_pattern")])
def test_names_filter_keeps_only_what_it_names(odd, names):
    _, cache = Hooked(odd).run_with_cache(torch.tensor([[3, 1, 4]]), names_filter=names)
    expected = [n for n in hook_names(3) if (names(n) if callable(names) else n in ([names] if isinstance(names, str)
                                                                                    else names))]
    assert list(cache) == expected and expected


def ablate_head(head: int):
    def fn(z, hook):
        z = z.clone()
        z[:, :, head] = 0.0
        return z
    return fn


def scale_q(q, hook):
    return q * 1.7


def test_a_hook_that_replaces_an_activation_matches_transformer_lens_s_run_with_hooks(odd):
    lens, hooked = lens_of(odd), Hooked(odd)
    ids = torch.tensor([[5, 3, 9, 1, 22, 0, 7]])
    hooks = [("blocks.1.attn.hook_z", ablate_head(2)), ("blocks.0.attn.hook_q", scale_q)]
    theirs = lens.run_with_hooks(ids, fwd_hooks=hooks)
    ours = hooked.run_with_hooks(ids, fwd_hooks=hooks)
    assert worst(theirs, ours) <= TOL
    assert worst(lens(ids), ours) > 1e-3  # the hooks did change the logits
    assert hooked._hooks == [] and torch.equal(hooked(ids), odd(ids)[0])  # removed afterwards


def test_hooks_run_in_the_order_attached_and_a_none_keeps_the_activation(odd):
    seen = []
    hooked = Hooked(odd)
    hooked.add_hook("blocks.0.hook_resid_pre", lambda t, h: seen.append(("a", h.name, h.layer())))
    hooked.add_hook(lambda n: n == "blocks.0.hook_resid_pre", lambda t, h: seen.append(("b", h.name)) or t * 0)
    hooked.add_hook("hook_embed", lambda t, h: seen.append(("c", h.layer())))
    logits = hooked(torch.tensor([[1, 2]]))
    assert seen == [("c", None), ("a", "blocks.0.hook_resid_pre", 0), ("b", "blocks.0.hook_resid_pre")]
    _, cache = hooked.run_with_cache(torch.tensor([[1, 2]]), names_filter="blocks.0.hook_resid_pre")
    assert cache["blocks.0.hook_resid_pre"].abs().max() == 0  # the cache holds what the hooks left
    hooked.reset_hooks()
    assert not torch.allclose(hooked(torch.tensor([[1, 2]])), logits)


def test_no_hook_is_the_plain_forward_bit_for_bit_and_a_hooked_run_is_within_tolerance(odd):
    ids = torch.randint(0, 23, (3, 19), generator=torch.Generator().manual_seed(2))
    plain = odd(ids)[0]
    assert torch.equal(Hooked(odd)(ids), plain)  # no tap: the fused kernel, the same bits
    logits, _ = Hooked(odd).run_with_cache(ids)
    assert worst(plain, logits) <= TOL


def test_a_hooked_run_is_in_eval_mode_and_leaves_training_mode_as_it_was():
    model = perturbed(GPT(tiny_config(**{**ODD, "dropout": 0.3}))).train()
    ids = torch.tensor([[1, 2, 3, 4]])
    first, _ = Hooked(model).run_with_cache(ids)
    second = Hooked(model).run_with_hooks(ids, fwd_hooks=[("hook_embed", lambda t, h: None)])
    assert torch.equal(first, second) and model.training  # no dropout while hooked; mode restored
    model.eval()
    assert worst(model(ids)[0], first) <= TOL


def test_gradients_flow_through_a_hook_point(odd):
    kept = {}

    def keep(t, hook):
        t.retain_grad()
        kept[hook.name] = t
    with torch.enable_grad():
        logits = Hooked(odd).run_with_hooks(torch.tensor([[1, 2, 3]]), fwd_hooks=[("blocks.1.hook_resid_mid", keep)])
        logits[0, -1, 4].backward()
    assert kept["blocks.1.hook_resid_mid"].grad.abs().sum() > 0
    odd.zero_grad(set_to_none=True)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_cache_during_generation_equals_a_recompute_of_the_whole_sequence(odd, temperature):
    prompt = torch.tensor([[4, 8, 15], [16, 2, 11]])
    ids, cache = Hooked(odd).generate_with_cache(prompt, max_new_tokens=7, temperature=temperature, seed=3)
    assert ids.shape == (2, 10) and torch.equal(ids[:, :3], prompt)
    if temperature == 0:  # greedy: each token the argmax of a plain forward of what came before
        for t in range(3, 10):
            assert torch.equal(ids[:, t], odd(ids[:, :t])[0][:, -1].argmax(-1))
    _, whole = Hooked(odd).run_with_cache(ids[:, :-1])
    assert list(cache) == list(whole)
    for name in whole:
        assert cache[name].shape == whole[name].shape, name
        assert worst(whole[name], cache[name], name) <= TOL, name


def test_generation_caches_only_what_the_filter_names_and_refuses_a_window_too_long(odd):
    _, cache = Hooked(odd).generate_with_cache(torch.tensor([[1, 2]]), 3, names_filter="blocks.2.attn.hook_pattern")
    assert list(cache) == ["blocks.2.attn.hook_pattern"] and cache["pattern", 2].shape == (1, 3, 4, 4)
    assert torch.allclose(cache["pattern", 2].sum(-1), torch.ones(1, 3, 4))
    with pytest.raises(GptlabError, match="exceed the context of 19"):
        Hooked(odd).generate_with_cache(torch.tensor([[1, 2]]), 18)


def boom(t, hook):
    raise ValueError("no good")


def wrong_shape(t, hook):
    return t[..., :1]


@pytest.mark.parametrize("hook, message", [
    (("blocks.1.attn.hook_patern", boom), r"no hook point named 'blocks.1.attn.hook_patern'.*did you mean "
                                          r"blocks.1.attn.hook_pattern\?"),
    (("blocks.7.hook_resid_pre", boom), r"no hook point named 'blocks.7.hook_resid_pre'"),
    (("blocks.1.mlp.hook_post", boom), r"the hook boom on blocks.1.mlp.hook_post raised ValueError: no good"),
    (("blocks.0.hook_attn_out", wrong_shape), r"the hook wrong_shape on blocks.0.hook_attn_out returned "
                                              r"\(1, 3, 1\), expected a tensor of shape \(1, 3, 15\)"),
    (("hook_embed", lambda t, h: 3.0), r"returned float, expected a tensor"),
])
def test_a_bad_hook_is_one_clear_error_naming_it_and_no_hook_stays_attached(odd, hook, message):
    hooked = Hooked(odd)
    hooked.add_hook("hook_pos_embed", lambda t, h: None)  # attached before: stays
    with pytest.raises(HookError, match=message):
        hooked.run_with_hooks(torch.tensor([[1, 2, 3]]), fwd_hooks=[hook])
    assert len(hooked._hooks) == 1
    hooked.reset_hooks()
    assert torch.equal(hooked(torch.tensor([[1, 2, 3]])), odd(torch.tensor([[1, 2, 3]]))[0])
    assert isinstance(HookError("x"), GptlabError)  # the CLI shows it as one line, exit code 2


def test_a_bigram_has_no_hook_points():
    with pytest.raises(GptlabError, match="bigram"):
        Hooked(Bigram(tiny_config(arch="bigram", vocab_size=5)))
    with pytest.raises(GptlabError, match="bigram"):
        hooked_transformer(Bigram(tiny_config(arch="bigram", vocab_size=5)))


@pytest.mark.parametrize("shape", [ODD, {**ODD, "bias": False, "activation": "gelu_tanh", "n_head": 5}])
def test_the_exported_hooked_transformer_is_transformer_lens_s_own_conversion(shape):
    torch.manual_seed(1)
    model = perturbed(GPT(tiny_config(**shape))).eval()
    ids = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(4))
    theirs, their_cache = lens_of(model).run_with_cache(ids)
    exported = hooked_transformer(model)
    ours, cache = exported.run_with_cache(ids)
    assert torch.equal(theirs, ours)
    assert all(torch.equal(their_cache[n], cache[n]) for n in their_cache)
    assert worst(model(ids)[0], ours) <= TOL


def test_sampled_generation_draws_as_documented_and_the_default_is_greedy(odd):
    """Sampled: one torch.multinomial draw a row a step over softmax(logits / temperature), from a generator seeded
    `seed`, worked out here with the plain forward; the defaults: greedy, seed 0."""
    prompt = torch.tensor([[4, 8, 15], [16, 2, 11]])
    hooked = Hooked(odd)
    ids, _ = hooked.generate_with_cache(prompt, 6, names_filter="hook_embed", temperature=0.7, seed=11)
    g, out = torch.Generator().manual_seed(11), prompt
    for _ in range(6):
        last = odd(out)[0][:, -1].float()
        out = torch.cat([out, torch.multinomial(torch.softmax(last / 0.7, -1), 1, generator=g)], 1)
    assert torch.equal(ids, out)
    greedy = hooked.generate_with_cache(prompt, 6, names_filter="hook_embed")[0]
    assert not torch.equal(ids, greedy)  # the draws are not the argmax here, so a greedy slip would show
    assert torch.equal(greedy[:, 3:], torch.stack([hooked.generate_with_cache(greedy[:, :t], 1)[0][:, -1]
                                                   for t in range(3, 9)], 1))
    hot = hooked.generate_with_cache(prompt, 6, names_filter="hook_embed", temperature=0.7)[0]
    assert torch.equal(hot, hooked.generate_with_cache(prompt, 6, names_filter="hook_embed", temperature=0.7,
                                                       seed=0)[0])


def test_generation_to_the_context_s_last_position_one_step_or_none(odd):
    ids, cache = Hooked(odd).generate_with_cache(torch.tensor([[1, 2]]), 17)  # 2 + 17 = block_size 19
    assert ids.shape == (1, 19) and cache["blocks.0.hook_resid_pre"].shape == (1, 18, 15)
    ids, cache = Hooked(odd).generate_with_cache(torch.tensor([[1, 2]]), 1)
    assert ids.shape == (1, 3) and cache["pattern", 1].shape == (1, 3, 2, 2)
    ids, cache = Hooked(odd).generate_with_cache(torch.tensor([[1, 2]]), 0)
    assert torch.equal(ids, torch.tensor([[1, 2]])) and len(cache) == 0


class Raising:
    def __call__(self, t, hook):
        raise RuntimeError("nope")


def test_a_callable_without_a_name_is_named_by_its_type_and_a_name_far_from_any_gets_the_pattern(odd):
    with pytest.raises(HookError, match=r"the hook Raising on hook_embed raised RuntimeError: nope"):
        Hooked(odd).run_with_hooks(torch.tensor([[1]]), fwd_hooks=[("hook_embed", Raising())])
    with pytest.raises(HookError, match=r"no hook point named 'zzz' in this model: names look like blocks.0.attn"):
        Hooked(odd).run_with_hooks(torch.tensor([[1]]), fwd_hooks=[("zzz", Raising())])
    _, cache = Hooked(odd).run_with_cache(torch.tensor([[1, 2]]))
    assert cache["hook_scale"] is cache["ln_final.hook_scale"] and (1, 2) not in cache
    last = Hooked(odd).run_with_hooks(torch.tensor([[1, 2, 3]]), fwd_hooks=[("hook_embed", lambda t, h: None)],
                                      last_only=True)
    assert last.shape == (1, 1, 23) and worst(odd(torch.tensor([[1, 2, 3]]))[0][:, -1:], last) <= TOL


def test_the_exported_hooked_transformer_adds_no_bos_keeps_the_model_s_dtype_and_says_when_it_is_missing(
        monkeypatch):
    """A string given to the exported model is the text's ids alone (gptlab's ids have no BOS); a bf16 run gives a
    bf16 HookedTransformer; without TransformerLens, one line saying how to install it."""
    torch.manual_seed(1)
    model = perturbed(GPT(tiny_config(**ODD))).eval()
    lens = hooked_transformer(model)
    assert lens.cfg.default_prepend_bos is False and lens.cfg.dtype == torch.float32
    assert hooked_transformer(model.to(torch.bfloat16)).cfg.dtype == torch.bfloat16
    monkeypatch.setitem(sys.modules, "transformer_lens", None)  # an import of it raises ImportError
    with pytest.raises(GptlabError, match="TransformerLens is not installed: pip install 'transformer-lens==3.9.0'"):
        hooked_transformer(model)
