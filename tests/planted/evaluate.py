"""Planted bugs of the evaluate area: the windows a text is scored in, and what its nats are divided by."""

from planted import Planted

EVALUATE = "src/gptlab/evaluate.py"
TESTS = "tests/test_evaluate.py"
NATS = f"{TESTS}::test_the_nats_of_a_text_are_every_tokens_minus_log_p_from_its_window"
ANY_LENGTH = f"{TESTS}::test_any_length_and_context_scores_each_token_after_the_first_once"
BYTES = f"{TESTS}::test_bits_per_byte_count_utf8_bytes_and_bits_per_char_characters"
SPLIT = f"{TESTS}::test_a_data_folders_validation_split_is_scored_over_its_own_bytes"

PLANTED = [
    Planted("evaluate: bits per byte divided by characters instead of bytes", EVALUATE,
            [("return self.nats / math.log(2) / max(self.bytes, 1)",
              "return self.nats / math.log(2) / max(self.chars, 1)")],
            [BYTES, SPLIT]),
    Planted("evaluate: a scored file's byte count is its character count", EVALUATE,
            [("scores.append(score(model, name, tokens, len(text), len(text.encode())",
              "scores.append(score(model, name, tokens, len(text), len(text)")],
            BYTES),
    Planted("evaluate: the validation split's byte count is its character count", EVALUATE,
            [('score(model, f"{data.path} (val)", data.val, len(text), len(text.encode())',
              'score(model, f"{data.path} (val)", data.val, len(text), len(text)')],
            SPLIT),
    Planted("evaluate: one token per window never scored (windows of block_size tokens)", EVALUATE,
            [("rows = [ids[s:s + T + 1] for s in", "rows = [ids[s:s + T] for s in")],
            [NATS, ANY_LENGTH]),
    Planted("evaluate: windows start block_size + 1 apart (one token per window skipped)", EVALUATE,
            [("max(len(ids) - 1, 0), T))", "max(len(ids) - 1, 0), T + 1))")],
            [NATS, ANY_LENGTH]),
    Planted("evaluate: the padding of a ragged last window counted as predicted tokens", EVALUATE,
            [("count += int((y >= 0).sum())", "count += y.numel()")],
            [NATS, ANY_LENGTH]),
]
