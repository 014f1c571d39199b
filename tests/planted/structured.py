"""Planted bugs of constrained generation and the API's structured output (src/gptlab/inference/grammar.py,
rows.py's choice, the engine's masks, serve/structured.py, the scheduler's and the responses' share of it)."""

from planted import Planted

GRAMMAR = "src/gptlab/inference/grammar.py"
ROWS = "src/gptlab/inference/rows.py"
STRUCTURED = "src/gptlab/serve/structured.py"
RESPONSES = "src/gptlab/serve/responses.py"
SCHEDULER = "src/gptlab/serve/scheduler.py"
APP = "src/gptlab/serve/app.py"
T = "tests/test_structured.py"
API = "tests/test_structured_api.py"
LACKS = f"{T}::test_a_schema_no_instance_of_which_the_vocabulary_can_write_is_refused_naming_what_is_lacked"
AFTER = f"{T}::test_what_comes_after_a_free_value_is_checked_too"
ROUND_TRIP = f"{API}::test_a_tool_call_round_trip_under_each_tool_choice"
CANNOT = f"{API}::test_a_schema_the_vocabulary_cannot_write_is_400_naming_the_characters"
TOOL_CHOICE = "tests/test_tool_choice.py::test_required_calls_on_a_greeting_and_none_answers_a_weather_question_in_text"

PLANTED = [
    Planted("grammar: proposals not cut where the grammar refuses them", GRAMMAR, "Constraint.valid_prefix",
            [("return self.matcher.validate_tokens(list(tokens)) if tokens else 0", "return len(tokens)")],
            f"{T}::test_speculation_under_a_grammar_proposes_only_what_the_grammar_allows_and_changes_nothing"),
    Planted("grammar: a mask of two tokens taken as forced", GRAMMAR, "Constraint.allowed",
            [("if count == 1 else None", "if count == 2 else None")],
            f"{T}::test_a_token_the_mask_forces_is_taken_without_a_draw"),
    Planted("grammar: the next mask not computed while the model runs", GRAMMAR, "Constraint.prefetch",
            [("if self.queue or self._mask is not None or self.finished:",
              "if self.queue or self._mask is None or self.finished:")],
            f"{T}::test_the_next_mask_is_ready_after_a_step_where_it_is_computed_while_the_model_runs"),
    Planted("grammar: only end tokens left read as an end, not a dead end", GRAMMAR, "_stuck",
            [("return not count or (count == int(bits[list(ends)].sum()) and not matcher.is_accepting())",
              "return not count")],
            f"{T}::test_where_only_an_end_token_is_left_but_the_grammar_is_not_complete_it_is_a_dead_end_not_an_end"),
    Planted("grammar: required keys not read from the schema", GRAMMAR, "_missing_of_type",
            [('required = [k for k in schema.get("required", []) if isinstance(k, str)]', "required = []")],
            [LACKS, AFTER]),
    Planted("grammar: an array's items not checked", GRAMMAR, "_missing_of_type",
            [('out |= _missing(schema.get("items"), have) | ({","} if least > 1 else set())',
              'out |= _missing(schema.get("items"), have)')],
            [LACKS, AFTER, f"{T}::test_a_comma_between_two_required_values_is_named_where_the_vocabulary_lacks_it"]),
    Planted("rows: the mask not widened to a model with unused vocabulary rows", ROWS, "_widened",
            [("return allowed if allowed.numel() >= width else torch.nn.functional.pad(allowed, "
              "(0, width - allowed.numel()))",
              "return torch.nn.functional.pad(allowed, (0, width - allowed.numel()), value=True)")],
            f"{T}::test_a_model_with_unused_vocabulary_rows_never_draws_them_under_a_grammar"),
    Planted("responses: a tool call's finish reason stop", RESPONSES, "_message",
            [('"finish_reason": "tool_calls"}', '"finish_reason": "stop"}')], ROUND_TRIP),
    Planted("responses: tool_choice none read as a call", RESPONSES, "may_call",
            [('return structure is not None and structure.calls_tools and structure.source[1] != "none"',
              "return structure is not None and structure.calls_tools")],
            [ROUND_TRIP, TOOL_CHOICE]),
    Planted("responses: a streamed call's delta without its index", RESPONSES, "chat_stream",
            [('                        call["index"] = i\n', "                        pass\n")], ROUND_TRIP),
    Planted("scheduler: a complete grammar's end reported as length", SCHEDULER, "Scheduler._step",
            [('text += completion.close("stop" if row.finish else "length")', 'text += completion.close("length")')],
            f"{API}::test_a_pydantic_response_format_is_parsed_by_the_client"),
    Planted("scheduler: a dead end answered as a cut answer", SCHEDULER, "Scheduler._step",
            [("completion.finish_reason is None and not row.error:", "completion.finish_reason is None:")], CANNOT),
    Planted("app: tools a vocabulary cannot write not refused", APP, "_add_chat",
            [("            check_tools_writable(req.messages, served.tokenizer)\n", "            pass\n")], CANNOT),
]
