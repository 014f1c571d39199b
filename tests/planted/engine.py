"""Planted bugs of the engine, sampling and the text stream (src/gptlab/engine.py, sampling.py, textstream.py)."""

from planted import Planted

SAMPLING = "src/gptlab/sampling.py"
ENGINE = "src/gptlab/engine.py"
TEXTSTREAM = "src/gptlab/textstream.py"
T_SAMPLING = "tests/test_sampling.py"

PLANTED = [
    Planted("engine: top-k ties broken unstably", SAMPLING,
            [("stable=True).indices[..., :k]", "stable=False).indices[..., :k]")],
            [f"{T_SAMPLING}::test_top_k_breaks_a_tie_among_a_hundred_logits_toward_the_lower_ids",
             f"{T_SAMPLING}::test_top_k_keeps_the_k_largest_ties_toward_the_lower_id"]),
    Planted("engine: top-k by torch.topk (ties in no documented order)", SAMPLING,
            [("order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]",
              "order = torch.topk(logits, k, dim=-1).indices")],
            [f"{T_SAMPLING}::test_top_k_breaks_a_tie_among_a_hundred_logits_toward_the_lower_ids",
             f"{T_SAMPLING}::test_top_k_keeps_the_k_largest_ties_toward_the_lower_id"]),
    Planted("engine: temperature applied after top-p", SAMPLING,
            [("    logits = logits / cfg.temperature\n", ""),
             ("    logits = top_p_filter(logits, cfg.top_p)\n",
              "    logits = top_p_filter(logits, cfg.top_p)\n    logits = logits / cfg.temperature\n")],
            [f"{T_SAMPLING}::test_temperature_is_applied_before_top_p",
             f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"]),
    Planted("engine: top-p before top-k", SAMPLING,
            [("    logits = top_p_filter(logits, cfg.top_p)\n", ""),
             ("    if cfg.top_k is not None:\n",
              "    logits = top_p_filter(logits, cfg.top_p)\n    if cfg.top_k is not None:\n")],
            f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"),
    Planted("engine: penalties after temperature", SAMPLING,
            [("    logits = logits / cfg.temperature\n", ""),
             ("    logits = logits.float()\n", "    logits = logits.float() / max(cfg.temperature, 1e-9)\n")],
            f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"),
    Planted("engine: top-p keeps one token too few (mass including the token itself)", SAMPLING,
            [("mass_before = probs.cumsum(dim=-1) - probs", "mass_before = probs.cumsum(dim=-1)")],
            f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"),
    Planted("engine: repetition penalty multiplies positive logits", SAMPLING,
            [("logits / repetition, logits * repetition", "logits * repetition, logits / repetition")],
            [f"{T_SAMPLING}::test_greedy_takes_the_largest_penalised_logit",
             f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"]),
]
