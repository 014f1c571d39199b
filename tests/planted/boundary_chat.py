"""Planted bugs at the chat boundaries (issue 42, behaviour 6): the logprobs of a token that is half a character in
a streamed chat, another --chat-loss into the same folder, consecutive assistant turns when a conversation is cut
to the context, a conversation one below, at and one past the context, and damaged saved starts."""

from planted import Planted

API = "src/gptlab/serve/api.py"
RESPONSES = "src/gptlab/serve/responses.py"
SCHEDULER = "src/gptlab/serve/scheduler.py"
TEXTSTREAM = "src/gptlab/textstream.py"
CONV = "src/gptlab/data/conversations.py"
CHAT = "src/gptlab/chat.py"
HALF = "tests/test_serve_chat_bytes.py::test_a_streamed_chat_keeps_the_logprobs_of_tokens_that_are_half_a_character"
T = "tests/test_conversations.py"
LOSS = f"{T}::test_another_chat_loss_into_the_same_folder_is_refused_and_with_overwrite_rewrites_the_mask"
TOGETHER = f"{T}::test_consecutive_assistant_messages_stay_with_their_user_turn_when_a_conversation_is_split"
DROPPED = f"{T}::test_consecutive_assistant_messages_are_dropped_together_to_fit_the_context"
EDGES = f"{T}::test_a_conversation_just_below_at_and_past_the_context_is_split_at_whole_exchanges"
ONE_PAST = f"{T}::test_an_exchange_or_an_assistant_turn_one_past_the_context_is_refused_naming_it"
DAMAGED = f"{T}::test_a_saved_split_with_an_empty_piece_or_starts_off_its_ends_is_refused_in_one_line"
MASK = f"{T}::test_a_saved_mask_of_two_columns_is_refused_in_one_line"

PLANTED = [
    Planted("chatedge: a streamed chat drops the chunk of a token that shows no text, its logprobs with it", RESPONSES,
            "chat_stream", [("                if text or entries:", "                if text:")], HALF),
    Planted("chatedge: a non-streamed chat leaves out the logprobs of a token that shows no text", RESPONSES, "chat_response",
            [("            content[c] += logprob_content(info, token, ends)",
              "            content[c] += logprob_content(info, token, ends) if text else []")], HALF),
    Planted("chatedge: the scheduler computes logprobs only for tokens that release text", SCHEDULER, "Scheduler._step",
            [("if job.request.logprobs is not None else None",
              "if job.request.logprobs is not None and text else None")], HALF),
    Planted("chatedge: each token decoded alone, half a character shown as U+FFFD", TEXTSTREAM, "Completion.push",
            [("return self._release(self._decoder.push([token]), final=False)",
              "return self._release(self.tokenizer.decode([token]), final=False)")], HALF),
    Planted("chatedge: a row cut by the length drops the half character it ends on", TEXTSTREAM, "Completion.close",
            [("out = self._release(self._decoder.flush(), final=True)", 'out = self._release("", final=True)')],
            HALF),
    Planted("chatedge: --chat-loss left out of the chat fingerprint: another loss keeps the old mask", CONV,
            "build_chat", [("cfg.context, cfg.chat_loss, ", "cfg.context, ")], LOSS),
    Planted("chatedge: prepare --chat keeps any prepared folder as it is", "src/gptlab/data/prepare.py",
            "_prepare_chat",
            [('if _made_by(out) == built.meta["fingerprint"]:', "if _made_by(out) is not None:")], LOSS),
    Planted("chatedge: a new exchange at every message after an answer, consecutive answers cut apart", CONV, "pieces",
            [('if current and messages[i]["role"] != "assistant" and messages[i - 1]["role"] == "assistant":',
              'if current and messages[i - 1]["role"] == "assistant":')], TOGETHER),
    Planted("chatedge: fit_context drops one answer of several in a row with their question", CHAT, "fit_context",
            [('while end < len(kept) and kept[end]["role"] == "assistant":',
              'if end < len(kept) and kept[end]["role"] == "assistant":')], DROPPED),
    Planted("chatedge: a piece closed when the next exchange would fill the context exactly", CONV, "pieces",
            [("if body and _length(head + body + exchange) > context:",
              "if body and _length(head + body + exchange) >= context:")], EDGES),
    Planted("chatedge: an exchange that fills the context exactly with the system messages refused", CONV, "pieces",
            [("if _length(head + exchange) > context:", "if _length(head + exchange) >= context:")], EDGES),
    Planted("chatedge: an exchange one past the context taken", CONV, "pieces",
            [("if _length(head + exchange) > context:", "if _length(head + exchange) > context + 1:")], ONE_PAST),
    Planted("chatedge: an empty piece in saved starts accepted", CONV, "load_chat_split",
            [("np.any(starts[1:] <= starts[:-1])", "np.any(starts[1:] < starts[:-1])")], DAMAGED),
    Planted("chatedge: saved starts checked by their differences, which wrap around for unsigned ones", CONV,
            "load_chat_split", [("np.any(starts[1:] <= starts[:-1])", "np.any(np.diff(starts) <= 0)")], DAMAGED),
    Planted("chatedge: saved starts of floats or of another shape accepted", CONV, "load_chat_split",
            [("if mask.ndim != 1 or starts.ndim != 1 or not np.issubdtype(starts.dtype, np.integer) or len(mask) "
              "!= length", "if len(mask) != length")], DAMAGED),
    Planted("chatedge: a saved mask of another shape accepted", CONV, "load_chat_split",
            [("if mask.ndim != 1 or starts.ndim != 1", "if starts.ndim != 1")], MASK),
    Planted("chatedge: saved starts below 0 accepted", CONV, "load_chat_split",
            [("starts[0] != 0 or", "starts[0] > 0 or")], DAMAGED),
    Planted("chatedge: saved starts that end short of the split accepted", CONV, "load_chat_split",
            [("starts[-1] != length or", "starts[-1] > length or")], DAMAGED),
]
