"""What the Responses API tests share (tests/test_server_responses.py, test_server_codex.py):
`Served`, an in-process server over a scripted model with a Gemma 4 template (ours, and
Google's own where tests/data/templates/ has it: `gemma4_templates`), and readers of a
stream: `final_of` checks its framing, `added_up` builds the output items from the events
alone, `stream_events` reads raw Server-Sent Events."""

import json
from pathlib import Path

import httpx
from mlx_lm.utils import load_tokenizer

from mlx_spec.core.engine import Engine
from mlx_spec.server import ServerOptions, create_app
from scripted_model import EOS_ID, END_OF_TURN_ID, GOOGLE_SPECIAL_TOKENS, TOOL_TEMPLATE, InProcessServer, save_tokenizer

MODEL = "scripted"
CONTEXT = 200_000  # a Codex request is ~40 kB: a token per byte for the byte-level tokenizer
TEMPLATES = Path(__file__).parent / "data" / "templates"


def gemma4_templates() -> dict:
    """Our Gemma-4-shaped tool template, and Google's own where tests/data/templates/ has it
    (see its README.md)."""
    out = {"tool-template": TOOL_TEMPLATE}
    if (TEMPLATES / "gemma4.jinja").exists():
        out["google"] = (TEMPLATES / "gemma4.jinja").read_text()
    return out


def template_tokenizer(path: Path, name: str):
    """The byte-level tokenizer with Gemma 4's special tokens and the template `name`."""
    save_tokenizer(path, gemma4_templates()[name], GOOGLE_SPECIAL_TOKENS)
    return load_tokenizer(path, eos_token_ids=[EOS_ID, END_OF_TURN_ID])


def chat_tool(tool: dict) -> dict:
    """A Responses function tool in chat completions' shape."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


class Served:
    def __init__(self, tokenizer, model, engine=None, context: int = 4096):
        engine = engine or Engine(model, None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=context)
        self.tokenizer, self.model = tokenizer, engine.target
        self.server = InProcessServer(create_app(engine, tokenizer, ServerOptions(
            model_name=MODEL, gamma="0", context_length=context)))
        self.base = self.server.base
        self.client = self.server.client()

    def say(self, text: str) -> None:
        self.model.script = list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt(self, prompt_tokens: int) -> list[int]:
        """The prompt the model saw in the latest request."""
        return self.model.seen[:prompt_tokens]

    def post(self, body: dict, **kwargs) -> httpx.Response:
        return httpx.post(self.base + "/responses", json=body, timeout=120, **kwargs)


def final_of(events: list):
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


def added_up(events: list) -> list[dict]:
    """The output items the events describe, built from additions and deltas alone."""
    items: dict[int, dict] = {}
    for e in events:
        if e.type == "response.output_item.added":
            assert e.output_index == len(items)
            items[e.output_index] = e.item.model_dump(exclude_none=True)
        elif e.type == "response.content_part.added":
            items[e.output_index]["content"].append(e.part.model_dump(exclude_none=True))
        elif e.type == "response.output_text.delta":
            part = items[e.output_index]["content"][e.content_index]
            part["text"] += e.delta
            part["logprobs"] = part.get("logprobs", []) + [lp.model_dump(exclude_none=True) for lp in e.logprobs]
        elif e.type == "response.reasoning_text.delta":
            items[e.output_index]["content"][e.content_index]["text"] += e.delta
        elif e.type == "response.function_call_arguments.delta":
            items[e.output_index]["arguments"] += e.delta
        elif e.type == "response.output_item.done":
            items[e.output_index]["status"] = e.item.status
            assert items[e.output_index] == e.item.model_dump(exclude_none=True)
    return [items[i] for i in sorted(items)]


def without_ids(output) -> list[dict]:
    items = [item if isinstance(item, dict) else item.model_dump(exclude_none=True) for item in output]
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def stream_events(response: httpx.Response) -> list[dict]:
    """The SSE events of a streamed answer: each an `event:` line naming its data's type."""
    assert response.status_code == 200, response.text
    events = []
    for block in response.text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events
