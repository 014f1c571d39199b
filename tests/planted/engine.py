"""Planted bugs of the engine, sampling and the text stream (src/gptlab/engine.py, sampling.py, textstream.py)."""

from planted import Planted

SAMPLING = "src/gptlab/sampling.py"
ENGINE = "src/gptlab/engine.py"
ROWS = "src/gptlab/inference/rows.py"
PREFIX = "src/gptlab/inference/prefix_cache.py"
TEXTSTREAM = "src/gptlab/textstream.py"
T_SAMPLING = "tests/test_sampling.py"

PLANTED = [
    Planted("engine: top-k ties broken unstably", SAMPLING, "top_k_filter",
            [("stable=True).indices[..., :k]", "stable=False).indices[..., :k]")],
            [f"{T_SAMPLING}::test_top_k_breaks_a_tie_among_a_hundred_logits_toward_the_lower_ids",
             f"{T_SAMPLING}::test_top_k_keeps_the_k_largest_ties_toward_the_lower_id"]),
    Planted("engine: top-k by torch.topk (ties in no documented order)", SAMPLING, "top_k_filter",
            [("order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :k]",
              "order = torch.topk(logits, k, dim=-1).indices")],
            [f"{T_SAMPLING}::test_top_k_breaks_a_tie_among_a_hundred_logits_toward_the_lower_ids",
             f"{T_SAMPLING}::test_top_k_keeps_the_k_largest_ties_toward_the_lower_id"]),
    Planted("engine: temperature applied after top-p", SAMPLING, "next_token",
            [("    logits = logits / cfg.temperature\n", ""),
             ("    logits = top_p_filter(logits, cfg.top_p)\n",
              "    logits = top_p_filter(logits, cfg.top_p)\n    logits = logits / cfg.temperature\n")],
            [f"{T_SAMPLING}::test_temperature_is_applied_before_top_p",
             f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"]),
    Planted("engine: top-p before top-k", SAMPLING, "next_token",
            [("    logits = top_p_filter(logits, cfg.top_p)\n", ""),
             ("    if cfg.top_k is not None:\n",
              "    logits = top_p_filter(logits, cfg.top_p)\n    if cfg.top_k is not None:\n")],
            f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"),
    Planted("engine: penalties after temperature", SAMPLING, "next_token",
            [("    logits = logits / cfg.temperature\n", ""),
             ("    logits = logits.float()\n", "    logits = logits.float() / max(cfg.temperature, 1e-9)\n")],
            f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"),
    Planted("engine: top-p keeps one token too few (mass including the token itself)", SAMPLING, "top_p_filter",
            [("mass_before = probs.cumsum(dim=-1) - probs", "mass_before = probs.cumsum(dim=-1)")],
            f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"),
    Planted("engine: repetition penalty multiplies positive logits", SAMPLING, "apply_penalties",
            [("logits / repetition, logits * repetition", "logits * repetition, logits / repetition")],
            [f"{T_SAMPLING}::test_greedy_takes_the_largest_penalised_logit",
             f"{T_SAMPLING}::test_draws_come_from_the_documented_distribution"]),
]

T_ENGINE = "tests/test_engine.py"
REFERENCE = f"{T_ENGINE}::test_running_batch_equals_the_plain_forward_over_the_documented_window"
SEEDS = f"{T_ENGINE}::test_each_sample_of_each_prompt_is_that_prompt_alone_with_seed_plus_i"

PLANTED += [
    Planted("engine: sample i of prompt 2+ seeded by its row, not its sample", ENGINE, "RunningBatch.join",
            [("RowSampler(cfg, row_seed(cfg.seed, i), window, vocab, self.device, steer)",
              "RowSampler(cfg, row_seed(cfg.seed, len(self.rows) + i), window, vocab, self.device, steer)")],
            SEEDS),
    Planted("engine: RunningBatch ignores the prompt in penalties", ENGINE, "RunningBatch.join",
            [("RowSampler(cfg, row_seed(cfg.seed, i), window, vocab, self.device, steer)",
              "RowSampler(cfg, row_seed(cfg.seed, i), [], vocab, self.device, steer)")],
            REFERENCE),
    Planted("engine: RunningBatch slides its window one token early", ENGINE, "RunningBatch._draw",
            [("push(row.window, token, self.block_size, self.keep)",
              "push(row.window, token, self.block_size - 1, self.keep)")],
            REFERENCE),
]

RAGGED = f"{T_ENGINE}::test_each_row_of_a_ragged_batch_equals_the_plain_forward_with_penalties"
GREEDY = f"{T_ENGINE}::test_cached_greedy_equals_the_plain_forward_for_200_tokens_across_the_window_boundary"

PLANTED += [
    Planted("engine: the reference slides its window one token early", ENGINE, "Reference.choose",
            [("push(window, i, self.block_size, self.keep)", "push(window, i, self.block_size - 1, self.keep)")],
            [GREEDY, RAGGED]),
    Planted("engine: the reference ignores the prompt in penalties", ENGINE, "Reference.__init__",
            [("RowSampler(cfg, row_seed(cfg.seed, r % num_samples), w, vocab, self.device, steer)",
              "RowSampler(cfg, row_seed(cfg.seed, r % num_samples), [], vocab, self.device, steer)")],
            f"{T_ENGINE}::test_the_uncached_reference_decodes_what_the_plain_loop_decodes_with_penalties"),
    Planted("engine: generated tokens not counted for the penalties", ROWS, "RowSampler.choose",
            [("            self.counts[0, i] += 1\n", "            pass\n")],
            [RAGGED, REFERENCE]),
    Planted("engine: the window keeps half of block_size, not 3/4", ROWS, "window_keep",
            [("return max(1, block_size * 3 // 4)", "return max(1, block_size // 2)")],
            [GREEDY, REFERENCE]),
    Planted("engine: a prefix cache hit reuses the chunk that holds the prompt's last token", PREFIX, "prompt_pass",
            [("(T if logits == \"none\" else T - 1) // chunk", "T // chunk")],
            [f"tests/test_prefix_cache.py::test_only_whole_chunks_before_the_last_token_are_reused",
             f"tests/test_prefix_cache.py::test_the_prompt_chunk_is_crossed_below_at_and_one_past_its_edges"]),
    Planted("engine: the prefix cache evicts the most recently used block", PREFIX, "PrefixCache._touch",
            [("for block in reversed(chain):", "for block in chain:")],
            "tests/test_prefix_cache.py::test_the_budget_is_never_exceeded_and_least_recently_used_leaves_go_first"),
    Planted("engine: a relayout copies one cache position too few", ENGINE, "RunningBatch._relayout",
            [("                n = row.filled\n", "                n = row.filled - 1\n")],
            REFERENCE),
    Planted("engine: a row that leaves does not relay the cache out", ENGINE, "RunningBatch.leave",
            [("                self._joining.pop(row, None)\n            self._moved = True",
              "                self._joining.pop(row, None)")],
            REFERENCE),
]

T_TEXT = "tests/test_textstream.py"
STREAM = f"{T_TEXT}::test_streamed_text_is_the_decoded_ids_up_to_the_first_stop_and_never_half_a_character"

PLANTED += [
    Planted("engine: text stream holds back one character too few of a partial stop", TEXTSTREAM, "_held_back",
            [("range(min(len(stop) - 1, len(text)), longest, -1)", "range(min(len(stop) - 2, len(text)), longest, -1)")],
            STREAM),
    Planted("engine: text stream cuts at the last stop found, not the first", TEXTSTREAM, "Completion._release",
            [("pending[:min(hits)]", "pending[:max(hits)]")],
            STREAM),
    Planted("engine: text stream looks for stops in the newest text only", TEXTSTREAM, "Completion._release",
            [("(pending.find(s) for s in self.stop)", "(new.find(s) for s in self.stop)")],
            STREAM),
    Planted("engine: text stream decodes each token alone (half characters as U+FFFD)", TEXTSTREAM, "Completion.push",
            [("self._release(self._decoder.push([token]), final=False)",
              "self._release(self.tokenizer.decode([token]), final=False)")],
            STREAM),
    Planted("engine: text stream keeps the held-back text at the end", TEXTSTREAM, "Completion._release",
            [("held = 0 if final else _held_back(pending, self.stop)", "held = _held_back(pending, self.stop)")],
            STREAM),
    Planted("engine: the stream ends when any row has finished", TEXTSTREAM, "TextStream.__iter__",
            [("if all(row.finish_reason is not None for row in self.completions)",
              "if any(row.finish_reason is not None for row in self.completions)")],
            f"{T_TEXT}::test_rows_stop_independently_and_the_stream_ends_when_all_have"),
]
