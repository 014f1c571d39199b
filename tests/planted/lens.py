"""Planted bugs of the looking-inside-as-researchers-do area: the model's hook points, the hooks' runner, patching,
the head detectors and the training probe."""

from planted import Planted

MODEL = "src/gptlab/model.py"
HOOKS = "src/gptlab/inspect/hooks.py"
PATCHING = "src/gptlab/inspect/patching.py"
HEADS = "src/gptlab/heads.py"
PARITY = "tests/test_hooks.py::test_every_hook_tensor_and_the_logits_match_transformer_lens"
TL_SWEEPS = "tests/test_patching.py::test_each_activation_patching_sweep_is_transformer_lens_own"

PLANTED = [
    Planted("lens: hook_scale without the epsilon (the unfolded LayerNorm's scale)", MODEL, "layer_norm",
            [("(x.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()", "x.pow(2).mean(-1, keepdim=True).sqrt()")],
            PARITY),
    Planted("lens: the hooked path's softmax over the queries, not the keys", MODEL, "CausalSelfAttention._naive",
            [('F.softmax(tap("attn.hook_attn_scores", att), dim=-1))',
              'F.softmax(tap("attn.hook_attn_scores", att), dim=-2))')],
            PARITY),
    Planted("lens: hook_z with heads and positions swapped back (B, H, T, D)", MODEL, "CausalSelfAttention.forward",
            [('y = tap("attn.hook_z", y.transpose(1, 2)).reshape(B, T, C)',
              'y = tap("attn.hook_z", y).transpose(1, 2).reshape(B, T, C)')],
            PARITY),
    Planted("lens: the MLP's hook_post read before the GELU", MODEL, "MLP.forward",
            [('tap("mlp.hook_post", self.gelu(tap("mlp.hook_pre", self.c_fc(x))))',
              'self.gelu(tap("mlp.hook_post", tap("mlp.hook_pre", self.c_fc(x))))')],
            PARITY),
    Planted("lens: a hook's replacement ignored (the activation goes on unchanged)", HOOKS, "_apply",
            [("if out is None:\n        return t", "if True:\n        return t")],
            "tests/test_hooks.py::test_a_hook_that_replaces_an_activation_matches_transformer_lens_s_run_with_hooks"),
    Planted("lens: run_with_hooks leaves its hooks attached when one raises", HOOKS, "Hooked.hooks",
            [("        finally:\n            del self._hooks[before:]", "        except KeyError:\n            pass")],
            "tests/test_hooks.py::test_a_bad_hook_is_one_clear_error_naming_it_and_no_hook_stays_attached"),
    Planted("lens: generation's cache pads a step's pattern with -inf and its scores with 0", HOOKS, "_joined",
            [('fill = float("-inf") if name.endswith("scores") else 0.0',
              'fill = 0.0 if name.endswith("scores") else float("-inf")')],
            "tests/test_hooks.py::test_the_cache_during_generation_equals_a_recompute_of_the_whole_sequence"),
    Planted("lens: a patched run restarts from the layer after the one patched", HOOKS, "run_from",
            [("for i in range(layer, model.config.n_layer):", "for i in range(layer + 1, model.config.n_layer):")],
            TL_SWEEPS),
    Planted("lens: attribution patching's sign flipped (corrupted minus clean)", PATCHING, "attribution_patch",
            [("((clean_cache[p] - kept[p]) * g)", "((kept[p] - clean_cache[p]) * g)")],
            "tests/test_patching.py::"
            "test_attribution_patching_is_activation_patching_where_the_metric_is_linear_and_not_elsewhere"),
    Planted("lens: induction read one key too early (the duplicate token itself)", HEADS, "scores_from_patterns",
            [("induction=_diagonal_mean(stack, half - 1, half)", "induction=_diagonal_mean(stack, half, half)")],
            "tests/test_heads.py::test_induction_and_duplicate_heads_score_one_on_their_own_diagonal_only"),
]
