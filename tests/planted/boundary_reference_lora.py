"""Planted bugs at the naive engine's and LoRA's edges (issue 42, behaviours 4 and 5): `reference check`'s relative
difference, the engine's own dropout masks at a p that is not 0.5, LayerNorm's epsilon off its default, the clock
`bench reference` splits a step by (tests/test_reference_edges.py); the adapters' dropout and scaling in training
mode beside PEFT's, and the PEFT settings `gptlab import peft` must refuse (tests/test_lora_edges.py)."""

from planted import Planted

CHECK = "src/gptlab/reference/check.py"
RMODEL = "src/gptlab/reference/naive_gpt.py"
CPP = "src/gptlab/reference/csrc/reference.cpp"
BENCH = "src/gptlab/bench/reference.py"
LORA = "src/gptlab/lora.py"
PEFT = "src/gptlab/hf/peft.py"
R = "tests/test_reference_edges.py"
BY_HAND = f"{R}::test_the_relative_difference_is_the_largest_gap_over_the_references_largest_magnitude"
KNOWN_GAPS = f"{R}::test_reference_check_reports_the_known_gaps_of_an_engine_made_to_differ"
MASK_VALUES = f"{R}::test_the_engines_masks_are_zero_or_one_over_one_minus_p_as_torchs_dropout_is"
MASK_LAW = f"{R}::test_the_engines_own_masks_drop_a_fraction_p_and_keep_the_mean_multiplier_one"
OWN_MASKS = f"{R}::test_a_naive_gpt_training_on_its_own_masks_gives_torchs_loss_and_gradients_under_them"
EPS_PIECE = f"{R}::test_layernorm_at_a_non_default_epsilon_matches_autograd"
EPS_MODEL = f"{R}::test_the_whole_model_at_epsilon_1e_2_without_biases_with_tanh_gelu_and_7_wide_heads_matches_torch"
CLOCK = f"{R}::test_each_function_of_the_engine_is_clocked_on_its_own_once_a_call"
BENCH_CLOCK = f"{R}::test_bench_reference_gives_each_function_its_calls_per_timed_step_on_the_ticking_clock"
L = "tests/test_lora_edges.py"
TRAINING = f"{L}::test_in_training_the_adapters_dropout_sits_on_the_a_paths_input_as_in_peft"
HAND_DROPOUT = f"{L}::test_the_adapters_dropout_keeps_a_fraction_1_minus_p_scaled_by_alpha_over_r_over_1_minus_p"
REFUSED = f"{L}::test_a_peft_setting_gptlab_does_not_implement_is_refused_in_one_line_naming_it"
SORTED = f"{L}::test_every_setting_of_peft_s_lora_config_is_either_read_refused_or_known_to_change_nothing"
LORA_FORWARD = ("return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * "
                "self.scaling")

PLANTED = [
    # `reference check`: max |a - b| / max |b|, b torch's
    Planted("refedge: check divides by the engine's largest magnitude, not torch's", CHECK, "difference",
            [("scale = b.double().abs().max().item()", "scale = a.double().abs().max().item()")],
            [BY_HAND, KNOWN_GAPS]),
    Planted("refedge: check's relative difference taken element by element", CHECK, "difference",
            [("return Difference(name, gap, gap / scale if scale > 0 else (0.0 if gap == 0 else float(\"inf\")))",
              "return Difference(name, gap, ((a.double() - b.double()).abs() / b.double().abs()).nan_to_num(0.0)"
              ".max().item())")], BY_HAND),
    Planted("refedge: check subtracts in float32", CHECK, "difference",
            [("gap = (a.double() - b.double()).abs().max().item()",
              "gap = (a.float() - b.float()).abs().max().item()")],
            BY_HAND),
    Planted("refedge: check's torch side keeps its dropout", CHECK, "compare_engines",
            [(".to(dtype).eval().requires_grad_(True)", ".to(dtype).requires_grad_(True)")], KNOWN_GAPS),
    # the engine's own dropout masks
    Planted("refedge: the masks scale by 1 / p", RMODEL, "DropoutMasks.draw.mask",
            [("return (torch.rand(shape) >= p).to(dtype) / (1 - p)", "return (torch.rand(shape) >= p).to(dtype) / p")],
            [MASK_VALUES, MASK_LAW]),
    Planted("refedge: the masks keep an element with probability p", RMODEL, "DropoutMasks.draw.mask",
            [("return (torch.rand(shape) >= p).to(dtype) / (1 - p)",
              "return (torch.rand(shape) < p).to(dtype) / (1 - p)")],
            MASK_LAW),
    Planted("refedge: the masks left unscaled", RMODEL, "DropoutMasks.draw.mask",
            [("return (torch.rand(shape) >= p).to(dtype) / (1 - p)", "return (torch.rand(shape) >= p).to(dtype)")],
            [MASK_VALUES, MASK_LAW]),
    Planted("refedge: NaiveGPT draws its masks at a fixed p", RMODEL, "NaiveGPT.draw_masks",
            [("return DropoutMasks.draw(self, B, T, p, ", "return DropoutMasks.draw(self, B, T, 0.1, ")], MASK_LAW),
    Planted("refedge: the engine drops the attention's output where torch drops the MLP's", RMODEL, "step",
            [("library.Masks(_ptr(a), _ptr(r), _ptr(m)) for a, r, m",
              "library.Masks(_ptr(a), _ptr(m), _ptr(r)) for a, r, m")],
            OWN_MASKS),
    # LayerNorm's epsilon
    Planted("refedge: the blocks' LayerNorms at a fixed epsilon of 1e-5", CPP, "block_forward",
            [("N, C, m.eps, a.ln1.data()", "N, C, 1e-5, a.ln1.data()"),
             ("N, C, m.eps, a.ln2.data()", "N, C, 1e-5, a.ln2.data()")], EPS_MODEL),
    Planted("refedge: ln_f at a fixed epsilon of 1e-5", CPP, "model_step",
            [("N, C, m.eps, xf.data()", "N, C, 1e-5, xf.data()")], EPS_MODEL),
    Planted("refedge: the engine handed the default epsilon", RMODEL, "model_struct",
            [("eps=c.layer_norm_eps", "eps=1e-5")], EPS_MODEL),
    Planted("refedge: epsilon added outside the square root", CPP, "layernorm_forward",
            [("R s = R(1) / std::sqrt(var + R(eps));", "R s = R(1) / (std::sqrt(var) + R(eps));")], EPS_PIECE),
    # the clock of `bench reference`
    Planted("refedge: linear_backward clocked as linear_forward", CPP, "linear_backward",
            [("Timed timed(LINEAR_B);", "Timed timed(LINEAR_F);")], CLOCK),
    Planted("refedge: each GELU clocked inside gelu_forward's clock", CPP, "gelu",
            [("R gelu(R x, bool tanh_form) {\n", "R gelu(R x, bool tanh_form) {\n    Timed timed(GELU_F);\n")], CLOCK),
    Planted("refedge: the pieces' names out of their order", CPP, None,
            [('"linear_forward", "linear_backward",', '"linear_backward", "linear_forward",')], CLOCK),
    Planted("refedge: the bench resets the clock before its warm-up", BENCH, "time_shape",
            [("if step == warmup:", "if step == 0:")], BENCH_CLOCK),
    Planted("refedge: the bench's times by function not divided by the steps", BENCH, "shape_result",
            [("functions = {k: v / steps for k, v", "functions = {k: v for k, v")], BENCH_CLOCK),
    # LoRA's dropout and scaling, beside PEFT's
    Planted("loraedge: the adapters' dropout on the A path's output", LORA, "LoRALinear.forward",
            [("self.lora_B(self.lora_A(self.lora_dropout(x)))", "self.lora_B(self.lora_dropout(self.lora_A(x)))")],
            TRAINING),
    Planted("loraedge: the adapters' dropout on the update", LORA, "LoRALinear.forward",
            [("self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling",
              "self.lora_dropout(self.lora_B(self.lora_A(x))) * self.scaling")], TRAINING),
    Planted("loraedge: the adapters' dropout on the base path's input too", LORA, "LoRALinear.forward",
            [(LORA_FORWARD, "x = self.lora_dropout(x)\n        "
                            "return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x)) * self.scaling")],
            TRAINING),
    Planted("loraedge: the adapters' dropout made at 1 - p", LORA, "LoRALinear.__init__",
            [("Dropout(dropout) if dropout > 0", "Dropout(1 - dropout) if dropout > 0")], [TRAINING, HAND_DROPOUT]),
    Planted("loraedge: the adapters' dropout on in eval mode too", LORA, "LoRALinear.forward",
            [("self.lora_A(self.lora_dropout(x))",
              "self.lora_A(F.dropout(x, getattr(self.lora_dropout, 'p', 0.0)))")], [TRAINING, HAND_DROPOUT]),
    Planted("loraedge: scaling alpha / sqrt(r), rsLoRA's", LORA, "LoRALinear.__init__",
            [("self.scaling = alpha / rank", "self.scaling = alpha / math.sqrt(rank)")], [TRAINING, HAND_DROPOUT]),
    Planted("loraedge: scaling r / alpha", LORA, "LoRALinear.__init__",
            [("self.scaling = alpha / rank", "self.scaling = rank / alpha")], [TRAINING, HAND_DROPOUT]),
    # `gptlab import peft`: what gptlab's LoRA does not implement
    Planted("loraedge: use_rslora not refused", PEFT, None,
            [('{"use_dora": False, "use_rslora": False, ', '{"use_dora": False, ')],
            [f"{REFUSED}[use_rslora=True]", SORTED]),
    Planted("loraedge: bias 'all' not refused", PEFT, None,
            [('"lora_bias": False, "bias": "none",', '"lora_bias": False,')], [f"{REFUSED}[bias=all]", SORTED]),
    Planted("loraedge: aLoRA's invocation tokens not refused", PEFT, None,
            [('"alora_invocation_tokens": None, ', "")], [f"{REFUSED}[alora_invocation_tokens=[50,51]]", SORTED]),
    Planted("loraedge: a start by a name the deny-list lacks imported as plain LoRA (PiSSA's fast SVD)", PEFT,
            "_plain_targets", [('if config.get("init_lora_weights", True) not in _INITS:',
              'if config.get("init_lora_weights", True) in ("pissa", "olora", "corda", "loftq"):')],
            f"{REFUSED}[init_lora_weights=pissa_niter_4]"),
    Planted("loraedge: another task's adapter imported", PEFT, "_plain_targets",
            [('if config.get("task_type") not in _TASKS:', 'if False:')], f"{REFUSED}[task_type=SEQ_CLS]"),
    Planted("loraedge: a string target_modules read as one layer's name", PEFT, "_plain_targets",
            [('raise refuse("target_modules", " (a regular expression over whole module names)")',
              "targets = [targets]")], f"{REFUSED}[target_modules=c_attn]"),
    Planted("loraedge: a target outside gptlab's layers left to the training settings to name", PEFT, "_plain_targets",
            [("if isinstance(targets, list) and any(t not in LORA_TARGETS for t in targets):", "if False:")],
            f"{REFUSED}[target_modules=[c_attn,lm_head]]"),
]
