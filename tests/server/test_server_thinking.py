"""Thinking through the server (issue 30, item 2): Gemma 4's thought channel split out as
`reasoning_content` (OpenAI chat, whole and streamed) and `thinking` blocks (Anthropic
Messages, whole and streamed, with `budget_tokens` kept), read by the official `openai` and
`anthropic` clients; `chat_template_kwargs` reach the template; acceptance is reported
apart for thoughts and answer.

The model, tokenizer, templates and references are `thinking_support`'s: a scripted model
that writes a thought, then an answer; transformers' `apply_chat_template` for the prompt,
mlx-lm's `stream_generate` for the greedy text, split by `str.partition`.
"""

import httpx
import pytest
import thinking_support
from mlx_lm.utils import load_tokenizer
from scripted_model import END_OF_TURN_ID, EOS_ID, InProcessServer, ScriptedModel, save_tokenizer
from thinking_support import (
    ANSWER,
    ASK,
    END,
    MODEL,
    START,
    TEMPLATES,
    THINKING_TEMPLATE,
    THOUGHT,
    thinking_engine,
    tokenizer_for,
)

from mlx_spec.core.engine import Engine
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.server import ServerOptions, create_app


class Served:
    def __init__(self, tokenizer, drafter=None, gamma="0"):
        self.tokenizer = tokenizer
        engine = thinking_engine(tokenizer, drafter)
        self.model = engine.target
        self.server = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name=MODEL, gamma=gamma)))
        self.base = self.server.base

    def anthropic(self):
        from anthropic import Anthropic

        return Anthropic(base_url=self.base.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=list(TEMPLATES))
def served(request, tmp_path_factory):
    tokenizer = tokenizer_for(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])
    assert (tokenizer.think_start, tokenizer.think_end) == ("<|channel>thought", END)
    served = Served(tokenizer)
    yield served
    served.server.stop()


def reference(served: Served, messages, enable_thinking: bool):
    return thinking_support.reference(served.tokenizer, served.model, messages, enable_thinking)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_reasoning_content(served, stream):
    client = served.server.client()
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=200,
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    ids, thought, answer = reference(served, ASK, enable_thinking=True)
    assert thought == THOUGHT and answer == ANSWER  # the model thinks with thinking on
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
        stats = chunks[-1].model_extra["mlx_spec"]
        assert sum(bool(getattr(d, "reasoning_content", None)) for d in deltas) > 1  # it streams
    else:
        answer_ = client.chat.completions.create(**kwargs)
        message = answer_.choices[0].message
        reasoning, content = message.model_extra["reasoning_content"], message.content
        assert answer_.usage.prompt_tokens == len(ids)
        stats = answer_.model_extra["mlx_spec"]
    assert (reasoning, content) == (thought, answer)
    assert served.model.seen[: len(ids)] == ids  # the template's own rendering, token for token
    assert stats["thought_acceptance"]["drafted"] == stats["answer_acceptance"]["drafted"] == 0


def test_thinking_off_has_no_reasoning(served):
    """enable_thinking false: the prompt as the template renders it (an empty thought
    channel ends it, so the model answers at once), no reasoning_content."""
    ids, thought, answer = reference(served, ASK, enable_thinking=False)
    raw = httpx.post(f"{served.base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 200,
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    message = raw["choices"][0]["message"]
    assert served.model.seen[: len(ids)] == ids
    assert "<|channel>" not in message["content"] and message["content"] == answer
    assert message.get("reasoning_content", "") == thought


def test_history_reasoning_follows_the_template(served):
    """An assistant turn's reasoning_content (and thought markup in its content) goes to the
    template, which drops it from history, as transformers renders the same turn."""
    history = ASK + [{"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
                     {"role": "user", "content": "And 3+3?"}]
    ids, _, _ = reference(served, history, enable_thinking=True)
    raw = httpx.post(f"{served.base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": history, "max_tokens": 200,
        "chat_template_kwargs": {"enable_thinking": True}}).json()
    assert raw["usage"]["prompt_tokens"] == len(ids) and served.model.seen[: len(ids)] == ids
    assert THOUGHT not in served.tokenizer.decode(ids)


def test_reserved_template_kwargs_refused(served):
    response = httpx.post(f"{served.base}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs.add_generation_prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_blocks(served, stream):
    client = served.anthropic()
    kwargs = dict(model=MODEL, max_tokens=200, messages=ASK,
                  thinking={"type": "enabled", "budget_tokens": 150})
    if stream:
        with client.messages.stream(**kwargs) as events:
            kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
            message = events.get_final_message()
        assert "thinking_delta" in kinds and "signature_delta" in kinds and "text_delta" in kinds
    else:
        message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == THOUGHT and isinstance(message.content[0].signature, str)
    assert message.content[1].text == ANSWER
    # sent back, the thinking block is history the template drops
    again = client.messages.create(model=MODEL, max_tokens=200, messages=ASK + [
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": "And 3+3?"}], thinking={"type": "enabled", "budget_tokens": 150})
    ids, _, _ = reference(served, ASK + [{"role": "assistant", "content": ANSWER},
                                         {"role": "user", "content": "And 3+3?"}], enable_thinking=True)
    assert served.model.seen[: len(ids)] == ids
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == len(ids)


def test_anthropic_without_thinking_turns_it_off(served):
    message = served.anthropic().messages.create(model=MODEL, max_tokens=200, messages=ASK)
    ids, _, answer = reference(served, ASK, enable_thinking=False)
    assert served.model.seen[: len(ids)] == ids
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == answer


@pytest.mark.parametrize("stream", [False, True])
def test_budget_tokens_closes_the_thought(served, stream):
    """After budget_tokens thought tokens the end marker is forced: the thought holds the
    first tokens of the model's own, the answer follows the forced marker, and usage counts
    the forced tokens too."""
    budget = 12
    thought_ids = served.model.thought  # markers included, as the budget counts them
    expected = served.tokenizer.decode(thought_ids[:budget]).removeprefix(START)
    client = served.anthropic()
    kwargs = dict(model=MODEL, max_tokens=200, messages=ASK, thinking={"type": "enabled", "budget_tokens": budget})
    if stream:
        with client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.content[0].thinking == expected
    assert message.content[1].text == ANSWER
    assert message.usage.output_tokens == budget + 1 + len(served.model.answer_ids) + 1  # marker, <turn|>


def test_budget_must_be_below_max_tokens(served):
    response = httpx.post(f"{served.base}/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 10, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 10}})
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert "budget_tokens" in response.json()["error"]["message"]


def test_thinking_refused_for_a_model_that_does_not_think(tmp_path):
    tokenizer = load_tokenizer(save_tokenizer(tmp_path), eos_token_ids=[EOS_ID, END_OF_TURN_ID])
    engine = Engine(ScriptedModel(), None, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)
    server = InProcessServer(create_app(engine, tokenizer, ServerOptions(model_name=MODEL, gamma="0")))
    try:
        response = httpx.post(f"{server.base}/messages", timeout=60, json={
            "model": MODEL, "max_tokens": 100, "messages": ASK,
            "thinking": {"type": "enabled", "budget_tokens": 50}})
    finally:
        server.stop()
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("thinking:")


def test_acceptance_apart_for_thought_and_answer(tmp_path):
    """With an n-gram drafter (the thought repeats itself), rounds that began in the thought
    and the others are counted apart, and together they are all the drafting."""
    served = Served(tokenizer_for(tmp_path, THINKING_TEMPLATE), NgramDrafter(), gamma="3")
    try:
        raw = httpx.post(f"{served.base}/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK, "max_tokens": 200,
            "chat_template_kwargs": {"enable_thinking": True}}).json()
    finally:
        served.server.stop()
    _, thought, answer = reference(served, ASK, enable_thinking=True)
    message, stats = raw["choices"][0]["message"], raw["mlx_spec"]
    assert (message["reasoning_content"], message["content"]) == (thought, answer)
    parts = stats["thought_acceptance"], stats["answer_acceptance"]
    assert parts[0]["drafted"] > 0 and parts[0]["accepted"] > 0
    assert sum(p["drafted"] for p in parts) == stats["drafted"]
    assert sum(p["accepted"] for p in parts) == stats["accepted"]
    assert parts[0]["acceptance_rate"] == parts[0]["accepted"] / parts[0]["drafted"]


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_splitter_finds_markers_split_across_pieces(step):
    """Fed in pieces of any size, the text splits as `str.partition` splits it whole; a
    second thought is thought too; a marker cut off at the end is answer text."""
    from mlx_spec.apps.thinking import ThinkSyntax, ThoughtSplitter

    text = f"{START}{THOUGHT}{END}{ANSWER} {START}again{END} done <|chan"
    splitter = ThoughtSplitter(ThinkSyntax("<|channel>thought", END))
    pieces = [splitter.feed(text[i:i + step]) for i in range(0, len(text), step)] + [splitter.finish()]
    thought, answer = ("".join(p[i] for p in pieces) for i in (0, 1))
    assert thought == THOUGHT + "again"
    assert answer == f"{ANSWER}  done <|chan"
    opened = ThoughtSplitter(ThinkSyntax("<think>", "</think>"), thinking=True)
    assert opened.feed("\nhm</think>ok") == ("hm", "ok")


def test_history_thoughts_reach_a_template_that_shows_them(tmp_path):
    """A template that renders earlier thoughts (as Qwen's and DeepSeek's do) gets them from
    OpenAI's reasoning_content and from Anthropic's thinking blocks, as transformers renders
    the turn with reasoning_content."""
    shows = THINKING_TEMPLATE.replace(
        "{{ '<|turn>' + role + '\\n' }}",
        "{{ '<|turn>' + role + '\\n' }}{%- if message.reasoning_content -%}"
        "{{ '<|channel>thought\\n' + message.reasoning_content + '<channel|>' }}{%- endif -%}")
    served = Served(tokenizer_for(tmp_path, shows))
    history = [{"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
               {"role": "user", "content": "And 3+3?"}]
    try:
        ids, _, _ = reference(served, ASK + history, enable_thinking=True)
        assert THOUGHT in served.tokenizer.decode(ids)
        raw = httpx.post(f"{served.base}/chat/completions", timeout=60, json={
            "model": MODEL, "messages": ASK + history, "max_tokens": 200,
            "chat_template_kwargs": {"enable_thinking": True}}).json()
        assert raw["usage"]["prompt_tokens"] == len(ids) and served.model.seen[: len(ids)] == ids
        served.anthropic().messages.create(model=MODEL, max_tokens=200, messages=ASK + [
            {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                              {"type": "text", "text": ANSWER}]},
            history[1]], thinking={"type": "enabled", "budget_tokens": 150})
        assert served.model.seen[: len(ids)] == ids
    finally:
        served.server.stop()


def test_structured_output_with_thinking_is_refused_not_silently_wrong(served):
    """A grammar starts at the first generated token, which with thinking on is the thought:
    the combination is a 400 in each API's shape (not a thought forced into JSON), and the
    same request without thinking is answered."""
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "response_format": {"type": "json_object"}}
    refused = httpx.post(f"{served.base}/chat/completions", timeout=60,
                         json={**body, "chat_template_kwargs": {"enable_thinking": True}})
    assert refused.status_code == 400 and "thinking" in refused.json()["error"]["message"]
    answered = httpx.post(f"{served.base}/chat/completions", timeout=60,
                          json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert answered.status_code == 200, answered.text
    schema = {"type": "json_schema", "schema": {"type": "object"}}
    refused = httpx.post(f"{served.base.removesuffix('/v1')}/v1/messages", timeout=60, json={
        "model": MODEL, "messages": ASK, "max_tokens": 200, "output_config": {"format": schema},
        "thinking": {"type": "enabled", "budget_tokens": 150}})
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert "thinking" in refused.json()["error"]["message"]
