"""Planted bugs of speculation and predicted outputs (src/gptlab/inference/speculate.py, engine.py's drawing, the
verify step, serve's prediction)."""

from planted import Planted

SPECULATE = "src/gptlab/inference/speculate.py"
ENGINE = "src/gptlab/engine.py"
FUSED = "src/gptlab/inference/fused.py"
KERNEL = "src/gptlab/inference/csrc/decode.cpp"
API = "src/gptlab/serve/api.py"
RESPONSES = "src/gptlab/serve/responses.py"
SCHEDULER = "src/gptlab/serve/scheduler.py"
T = "tests/test_speculative.py"
SAME = f"{T}::test_two_hundred_prompts_give_the_same_tokens_and_logits_with_speculation_and_without"
VERIFY = f"{T}::test_a_verify_step_gives_every_position_the_bits_of_one_token_steps"
PREDICTED = f"{T}::test_a_predicted_output_gives_the_same_answer_and_counts_its_tokens_as_openai_does"
LOOKUP = f"{T}::test_a_row_proposes_what_followed_the_last_earlier_occurrence_of_its_longest_ngram"
SERVER = "tests/test_serve_prefix.py::test_a_server_that_speculates_answers_two_hundred_mixed_requests_byte_for_byte_as_one_that_does_not"

PLANTED = [
    Planted("speculation: every kept proposal drawn from the first proposal's logits", ENGINE, "RunningBatch._draw",
            [("logits = row.draft_logits[kept:kept + 1]", "logits = row.draft_logits[0:1]")], [SAME]),
    Planted("speculation: kept proposals do not move the row's filled positions on", ENGINE, "RunningBatch._draw",
            [("row.filled += kept", "row.filled += 0")], [SAME]),
    Planted("speculation: a proposal reaching the cache's last position", SPECULATE, "propose",
            [("cache.max_len - 1 - row.filled", "cache.max_len - row.filled")], [SAME]),
    Planted("speculation: the n-gram index one position late", SPECULATE, "Lookup._add",
            [("self.index[tuple(self.tokens[end - n:end])] = end", "self.index[tuple(self.tokens[end - n:end])] = end + 1")],
            [LOOKUP]),
    Planted("speculation: a repeat's period one too long", SPECULATE, "Lookup.propose",
            [("return [tokens[after + i % period]", "return [tokens[after + i % (period + 1)]")], [SAME, LOOKUP]),
    Planted("speculation: the verify's positions not copied to the kernel", FUSED, "FusedDecoder.verify",
            [("plan.pos.copy_(pos)", "plan.pos.zero_()")], [VERIFY]),
    Planted("speculation: the verify leaves the newest token unfilled", SPECULATE, "verify_proposals",
            [("row.filled += 1", "row.filled += 0")], [SAME]),
    Planted("speculation: a row's last token of a step closes it wherever it comes", SCHEDULER, "Scheduler._step",
            [("if row.left <= 0 and last[row] == i and completion.finish_reason is None and not row.error:",
              "if row.left <= 0 and completion.finish_reason is None and not row.error:")], [SERVER]),
    Planted("predicted outputs: text parts joined with a space", API, "_prediction",
            [('content = "".join(p["text"] for p in content)', 'content = " ".join(p["text"] for p in content)')],
            [PREDICTED]),
    Planted("predicted outputs: accepted and rejected swapped in usage", RESPONSES, "usage",
            [('"accepted_prediction_tokens": done.prediction[0]', '"accepted_prediction_tokens": done.prediction[1]'),
             ('"rejected_prediction_tokens": done.prediction[1]', '"rejected_prediction_tokens": done.prediction[0]')],
            [PREDICTED]),
    Planted("predicted outputs: the prediction followed two tokens at a time", SPECULATE, "Prediction.follow",
            [("self.at = self.floor = self.at + 1", "self.at = self.floor = self.at + 2")], [PREDICTED]),
    Planted("predicted outputs: a completion's prediction never encoded", API, "encode_prompts",
            [("    _encode_prediction(request, tokenizer)\n", "")], [PREDICTED]),
]
