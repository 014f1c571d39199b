"""Planted bugs of the server (src/gptlab/serve/api.py, app.py, responses.py, scheduler.py)."""

from planted import Planted

API = "src/gptlab/serve/api.py"
APP = "src/gptlab/serve/app.py"
RESPONSES = "src/gptlab/serve/responses.py"
SCHEDULER = "src/gptlab/serve/scheduler.py"
T = "tests/test_serve.py"

PLANTED = [
    Planted("serve: a client that leaves the queue keeps its place (the next request gets 429)", SCHEDULER,
            "Scheduler._fitting", [("size = 0 if job.cancelled.is_set() else job.size", "size = job.size")],
            f"{T}::test_a_client_that_leaves_the_queue_gives_its_place_back"),
    Planted("serve: echo puts another choice's prompt first (JSON response)", RESPONSES, "completion_response",
            [("texts = [req.prompts[c // req.n] if req.echo", "texts = [req.prompts[c % len(req.prompts)] if req.echo")],
            f"{T}::test_echo_puts_each_choices_own_prompt_before_its_text"),
    Planted("serve: echo puts another choice's prompt first (stream)", RESPONSES, "completion_stream",
            [("text = req.prompts[c // req.n]", "text = req.prompts[c // len(req.prompts)]")],
            f"{T}::test_echo_puts_each_choices_own_prompt_before_its_text"),
    Planted("serve: /metrics answers without the API key", APP, "_add_pages.metrics",
            [("async def metrics(request: Request) -> Response:\n        check_key(request)\n",
              "async def metrics(request: Request) -> Response:\n")],
            f"{T}::test_a_key_is_required_when_set"),
    Planted("serve: /inspect answers without the API key", APP, "_add_pages.inspect",
            [("async def inspect(request: Request) -> Response:\n        check_key(request)\n",
              "async def inspect(request: Request) -> Response:\n")],
            f"{T}::test_a_key_is_required_when_set"),
    Planted("serve: prompts x n past the batch are queued, and wait for ever", API, "parse_completion",
            [("if count * n > limits.max_batch:", "if n > limits.max_batch:")],
            f"{T}::test_more_sequences_than_the_batch_decodes_is_400_at_once"),
    Planted("serve: a prompt of exactly the context is refused", API, "_check_length",
            [("if len(ids) > most:", "if len(ids) >= most:")],
            f"{T}::test_a_prompt_as_long_as_the_context_is_accepted"),
    Planted("serve: the end-of-text finish reaches clients as 'eot', not OpenAI's 'stop'", SCHEDULER, "Scheduler._step",
            [('reason = {"eot": "stop"}.get(completion.finish_reason, completion.finish_reason)',
              "reason = completion.finish_reason")],
            f"{T}::test_end_of_text_finishes_a_choice_with_openais_stop"),
    Planted("serve: usage.prompt_tokens counts only the first prompt", SCHEDULER, "Scheduler._step",
            [("prompt = sum(map(len, job.request.ids))", "prompt = len(job.request.ids[0])")],
            f"{T}::test_usage_counts_each_prompt_once_however_many_choices"),
    Planted("serve: usage.prompt_tokens counts each prompt n times", SCHEDULER, "Scheduler._step",
            [("prompt = sum(map(len, job.request.ids))", "prompt = sum(map(len, job.request.ids)) * job.request.n")],
            f"{T}::test_usage_counts_each_prompt_once_however_many_choices"),
    Planted("serve: a null prompt is queued with nothing to decode (it hangs on an idle server)", API,
            "parse_completion", [('if body.get("prompt") is None:', 'if "prompt" not in body:')],
            f"{T}::test_a_bad_field_is_400_naming_it"),
    Planted("serve: a body nested too deep is a plain-text 500 (RecursionError)", APP, "_read_json",
            [("    except RecursionError:", "    except NotImplementedError:")],
            f"{T}::test_a_body_nested_too_deep_is_400_in_openais_shape"),
    Planted("serve: too many prompts for the batch blamed on n", API, "_too_many",
            [('f"{prompts} prompts are {limit}: send at most {most} prompts in one request", "prompt")',
              'f"{prompts} prompts x n={n} are {prompts * n} sequences, {limit}", "n")')],
            f"{T}::test_more_sequences_than_the_batch_decodes_is_400_at_once"),
    Planted("serve: tokens_generated counts a job's rows at each of its tokens", SCHEDULER, "Scheduler._step",
            [("            self.metrics.tokens += 1\n", "            self.metrics.tokens += len(job.rows)\n")],
            f"{T}::test_models_health_and_metrics"),
]
