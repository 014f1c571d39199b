"""Planted bugs of the evaluate area: the windows a text is scored in, and what its nats are divided by."""

from planted import Planted

EVALUATE = "src/gptlab/evaluate.py"
TESTS = "tests/test_evaluate.py"
NATS = f"{TESTS}::test_the_nats_of_a_text_are_every_tokens_minus_log_p_from_its_window"
ANY_LENGTH = f"{TESTS}::test_any_length_and_context_scores_each_token_after_the_first_once"
BYTES = f"{TESTS}::test_bits_per_byte_count_utf8_bytes_and_bits_per_char_characters"
SPLIT = f"{TESTS}::test_a_data_folders_validation_split_is_scored_over_its_own_bytes"
CHARS = "tests/test_bits_per_char.py"
SPECIALS = f"{CHARS}::test_eval_counts_the_held_out_documents_characters_and_bytes_not_the_end_of_text_markers"

PLANTED = [
    Planted("evaluate: bits per byte divided by characters instead of bytes", EVALUATE, "Score.bits_per_byte",
            [("return self.nats / math.log(2) / max(self.bytes, 1)",
              "return self.nats / math.log(2) / max(self.chars, 1)")],
            [BYTES, SPLIT]),
    Planted("evaluate: a scored text's byte count is its character count", EVALUATE, "score",
            [("return Score(name, count, len(text), len(text.encode()), nats, specials)",
              "return Score(name, count, len(text), len(text), nats, specials)")],
            [BYTES, SPLIT, SPECIALS]),
    Planted("evaluate: an end-of-text token or a chat marker counted as the characters of its spelling", EVALUATE,
            "score", [("text, specials = tokenizer.text_of(np.asarray(tokens).tolist())",
              "text, specials = tokenizer.decode(np.asarray(tokens).tolist()), 0")],
            [SPECIALS, f"{CHARS}::test_a_chat_splits_markers_count_no_characters"]),
    Planted("evaluate: one token per window never scored (windows of block_size tokens)", EVALUATE, "total_nats",
            [("rows = [ids[s:s + T + 1] for s in", "rows = [ids[s:s + T] for s in")],
            [NATS, ANY_LENGTH]),
    Planted("evaluate: windows start block_size + 1 apart (one token per window skipped)", EVALUATE, "total_nats",
            [("max(len(ids) - 1, 0), T))", "max(len(ids) - 1, 0), T + 1))")],
            [NATS, ANY_LENGTH]),
    Planted("evaluate: the padding of a ragged last window counted as predicted tokens", EVALUATE, "total_nats",
            [("count += int((y >= 0).sum())", "count += y.numel()")],
            [NATS, ANY_LENGTH]),
]
