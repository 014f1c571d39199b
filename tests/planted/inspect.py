"""Planted bugs of the inspect area: tracing, the logit lens, the labels drawn on its pictures."""

from planted import Planted

TRACE = "src/gptlab/inspect/trace.py"
LENS_ROWS = "tests/test_inspect.py::test_every_row_of_the_lens_is_ln_f_and_the_head_on_that_depths_stream"

PLANTED = [
    Planted("inspect: the logit lens skips the final LayerNorm at every depth but the last", TRACE,
            [("return torch.stack([gpt.lm_head(gpt.transformer.ln_f(x)) for x in tr.residual])",
              "return torch.stack([gpt.lm_head(x) for x in tr.residual[:-1]] + [tr.logits])")],
            LENS_ROWS),
    Planted("inspect: the logit lens's rows shifted one layer (row l reads the stream after block l + 1)", TRACE,
            [("ln_f(x)) for x in tr.residual])", "ln_f(x)) for x in tr.residual[1:] + tr.residual[-1:]])")],
            LENS_ROWS),
]
