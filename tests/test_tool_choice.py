"""tool_choice "auto" decides by the conversation: a tiny char model fine-tuned here on a small tool-use set (the
chat template's way of writing tools, calls and results: gptlab.serve.structured) calls get_weather when asked
about the weather and answers in text when greeted, through the official `openai` client; "required" calls on a
greeting too, "none" answers in text on a weather question."""

import json

import pytest
import torch
from helpers import trained_like

from gptlab.engine import one_thread
from gptlab.inference.loading import prepare_for_inference
from gptlab.serve.api import Limits
from gptlab.serve.app import Served, make_app
from gptlab.serve.server import start_server
from gptlab.serve.structured import tool_messages
from gptlab.tokenizer import CharTokenizer, ChatTokenizer

openai = pytest.importorskip("openai", reason="no openai client (pip install -e '.[test]')")
CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
    "additionalProperties": False}}}]
FUNCTIONS = [{"name": "get_weather", "description": "", "parameters": TOOLS[0]["function"]["parameters"]}]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Delhi"]
GREETINGS = ["hello", "hi there", "good morning", "thanks", "how are you", "good night"]


def conversations():
    """Weather questions answered with a call, greetings with text: as the server writes them."""
    out = []
    for city in CITIES:
        call = {"id": "call_0", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        out.append([{"role": "user", "content": f"weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]}])
    out += [[{"role": "user", "content": g}, {"role": "assistant", "content": "Hello to you!"}] for g in GREETINGS]
    return [tool_messages(c, FUNCTIONS) for c in out]


@pytest.fixture(scope="module")
def served():
    tokenizer = ChatTokenizer(CharTokenizer(CHARS))
    rows = [tokenizer.render(c) for c in conversations()]
    width = max(len(ids) for ids, _ in rows)
    torch.manual_seed(0)
    model = trained_like(dict(n_layer=2, n_head=2, n_embd=48, vocab_size=tokenizer.vocab_size, block_size=width + 64,
                              dropout=0.0))
    x = torch.zeros(len(rows), width, dtype=torch.long)
    y = torch.full((len(rows), width), -1, dtype=torch.long)
    for r, (ids, trained) in enumerate(rows):
        x[r, :len(ids)] = torch.tensor(ids)
        y[r, :len(ids) - 1] = torch.tensor([t if keep else -1 for t, keep in zip(ids[1:], trained[1:])])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    with one_thread():  # the same steps whatever threads the test runs with
        for _ in range(250):  # the answers only (the template's trained positions), to a loss near zero
            _, loss = model(x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    running = start_server(make_app(Served("tools", prepare_for_inference(model, "fp32"), tokenizer,
                                           model.num_params(), lambda: model), Limits(max_tokens=80)))
    yield running, loss.item()
    running.stop()


def ask(served, text, choice):
    client = openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model="tools", messages=[{"role": "user", "content": text}], tools=TOOLS,
                                          tool_choice=choice, temperature=0).choices[0]


def test_auto_calls_on_a_weather_question_and_answers_a_greeting_in_text(served):
    assert served[1] < 0.2  # the set is learnt (the mean over answers and end markers)
    for city in ("Paris", "Oslo", "Tokyo"):
        choice = ask(served, f"weather in {city}?", "auto")
        assert choice.finish_reason == "tool_calls", choice.message.content
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    for greeting in ("hello", "thanks"):
        choice = ask(served, greeting, "auto")
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        assert choice.message.content and not choice.message.content.startswith("<")


def test_required_calls_on_a_greeting_and_none_answers_a_weather_question_in_text(served):
    choice = ask(served, "hello", "required")
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    choice = ask(served, "weather in Rome?", "none")
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
