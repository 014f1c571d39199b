"""Planted bugs of the inspect area: tracing, the logit lens, the labels drawn on its pictures."""

from planted import Planted

TRACE = "src/gptlab/inspect/trace.py"
PICTURES = "src/gptlab/inspect/pictures.py"
TESTS = "tests/test_inspect.py"
LENS_ROWS = f"{TESTS}::test_every_row_of_the_lens_is_ln_f_and_the_head_on_that_depths_stream"
PARITY = f"{TESTS}::test_attention_and_residual_stream_equal_transformers"
ADDS_UP = f"{TESTS}::test_the_stream_adds_up_and_the_logits_are_the_models"
LABELS = f"{TESTS}::test_labels_drawn_on_pictures_escape_what_the_font_cannot_show"
APPLE = f"{TESTS}::test_the_apple_experiment"

PLANTED = [
    Planted("inspect: the logit lens skips the final LayerNorm at every depth but the last", TRACE, "logit_lens",
            [('gpt.lm_head(layer_norm(gpt.transformer.ln_f, x, same, "ln_final")) for x in tr.residual])',
              "gpt.lm_head(x) for x in tr.residual[:-1]] + [tr.logits])")],
            LENS_ROWS),
    Planted("inspect: the logit lens's rows shifted one layer (row l reads the stream after block l + 1)", TRACE,
            "logit_lens",
            [('"ln_final")) for x in tr.residual])', '"ln_final")) for x in tr.residual[1:] + tr.residual[-1:]])')],
            LENS_ROWS),
    Planted("inspect: the trace's residual stream read after each attention, not where each block starts", TRACE,
            "trace", [('return Trace(ids, each("hook_resid_pre")', 'return Trace(ids, each("hook_resid_mid")')],
            [PARITY, ADDS_UP]),
    Planted("inspect: the trace's attention probabilities read before the softmax (the scores)", TRACE, "trace",
            [('each("attn.hook_pattern"), logits)', 'each("attn.hook_attn_scores"), logits)')],
            [PARITY, ADDS_UP]),
    Planted("inspect: the word read one token after its last (the first position past the word)", TRACE, "find_word",
            [("if len(tokenizer.decode(ids[:i + 1])) >= end:", "if len(tokenizer.decode(ids[:i + 1])) > end:")],
            APPLE),
    Planted("inspect: the word's static vector looked up by its position, not its token", TRACE, "word_representations",
            [("static = gpt.transformer.wte.weight[ids[at]]", "static = gpt.transformer.wte.weight[at]")],
            APPLE),
    Planted("inspect: a carriage return labelled with ␍, a glyph the pictures' font lacks", TRACE, None,
            [('"\\r": "\\\\r"}', '"\\r": "␍"}')],
            LABELS),
    Planted("inspect: other control characters left in labels as they are", TRACE, "visible",
            [('return escape(ch) if unicodedata.category(ch)[0] in "CZ" else ch', "return ch")],
            LABELS),
    Planted("inspect: tick labels drawn without escaping what the font lacks", PICTURES, "_label_axes",
            [("ticks, labels = range(len(labels)), [drawable(label) for label in labels]",
              "ticks = range(len(labels))")],
            LABELS),
    Planted("inspect: the lens picture's cells drawn without escaping what the font lacks", PICTURES, "lens_png",
            [("ax.text(t, d, drawable(token_label(tokenizer, int(top[d, t]))),",
              "ax.text(t, d, token_label(tokenizer, int(top[d, t])),")],
            LABELS),
]
