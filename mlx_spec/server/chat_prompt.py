"""Chat prompts: a conversation through the model's chat template into token ids, with
control tokens only where the template writes them.

A tokenizer reads the text of its special tokens ("<start_of_turn>", "<|turn>") as those
tokens wherever it occurs, so a rendered template encoded as one text lets a message (or a
web page an agent quotes in one) write turn markers of its own. Here each such occurrence in
the strings a client sent (contents, call arguments, tool schemas) is swapped for a
private-use sentinel character before rendering; every control token in the rendered text
is then the template's own, and the text between them is encoded with special tokens split
(as transformers' `split_special_tokens`, llama.cpp's `parse_special=false`), the sentinels
put back. A conversation without control-token text renders and encodes exactly as before.
`parse_special=True` (`serve --parse-special-in-text`) keeps the old reading.
"""

from __future__ import annotations

import re
from functools import cached_property
from typing import Iterator, Optional

from mlx_spec.server.api_error import ApiError
from mlx_spec.server.images import content_texts
from mlx_spec.server.template_fit import alternated, requires_alternation, walked_tools, walks_schemas
from mlx_spec.server.tools import ToolPlan, native_tool_turns

SENTINELS = 0x100000  # Supplementary Private Use Area-B: no tokenizer gives these meaning


class ControlTokens:
    """The tokenizer's special tokens (its added tokens marked special) and where a text
    holds one, matched leftmost-longest as `tokenizers` matches them."""

    def __init__(self, tokenizer):
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.ids = {t.content: i for i, t in decoder.items() if t.special and t.content}
        lengths: dict[str, set] = {}
        for text in self.ids:
            lengths.setdefault(text[0], set()).add(len(text))
        self._lengths = {first: sorted(n, reverse=True) for first, n in lengths.items()}
        self._firsts = re.compile("[" + "".join(map(re.escape, lengths)) + "]") if lengths else None

    def spans(self, text: str) -> Iterator[tuple[int, int]]:
        """(start, end) of each control token's text in `text`, in order."""
        at = 0
        while self._firsts is not None and (found := self._firsts.search(text, at)):
            start = found.start()
            at = start + 1
            for n in self._lengths[text[start]]:
                if text[start:start + n] in self.ids:
                    yield start, start + n
                    at = start + n
                    break


class ChatPrompts:
    """Prompt ids of conversations for one tokenizer (used from the tokenizer thread).

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper` or our `FastTokenizer`.
        parse_special: read control-token text in messages as control tokens.
    """

    def __init__(self, tokenizer, parse_special: bool = False):
        self.tokenizer = tokenizer
        self.parse_special = parse_special
        template = str(getattr(tokenizer, "chat_template", None) or "")
        # A template that reads `tool_responses` (Gemma 4's) takes a tool's answer inside the
        # model's turn; others take it as a `tool` turn of its own.
        self.native_tool_turns = "tool_responses" in template
        # What agents send, fitted to what the template can render (`template_fit`).
        self.walks_schemas = walks_schemas(template)
        self.alternates = requires_alternation(template)

    @cached_property
    def controls(self) -> ControlTokens:  # FastTokenizer loads transformers' tokenizer for it
        return ControlTokens(self.tokenizer)

    def ids(self, messages: list[dict], plan: ToolPlan = ToolPlan(), continue_final: bool = False,
            generation_prompt: bool = True, template_kwargs: Optional[dict] = None) -> list[int]:
        """The messages (and the plan's tools) through the model's chat template, encoded
        without special tokens added, as mlx-lm's and transformers' `apply_chat_template`
        do; a forced tool call's start marker ends the prompt. `continue_final`: the last
        (assistant) message stays open and the answer continues it (transformers'
        `continue_final_message`); else `generation_prompt` opens the model's turn.
        `template_kwargs`: more variables for the template (`enable_thinking`).

        A system or user message the template leaves out (Gemma's puts a system turn into
        the first user turn, and with no user turn drops it) is refused rather than silently
        unanswered; assistant and tool turns are not checked, as templates may rewrite them
        on purpose (reasoning dropped from history, results re-serialized)."""
        if plan.forced and continue_final:
            raise ApiError(400, "tool_choice: a forced tool call cannot continue a prefilled "
                                "assistant message", param="tool_choice")
        if self.alternates:
            messages = alternated(messages)
        tools = walked_tools(plan.tools) if self.walks_schemas else plan.tools
        messages, tools, restore = ((messages, tools, {}) if self.parse_special
                                    else self._defused([messages, tools]))
        text = self._render(native_tool_turns(messages) if self.native_tool_turns else messages, tools,
                            continue_final, generation_prompt and not continue_final, template_kwargs or {})
        for i, message in enumerate(messages):
            if message["role"] in ("system", "user") and any(
                    part.strip() not in text for part in content_texts(message["content"])):
                hint = ""
                if message["role"] == "system" and all(m["role"] != "user" for m in messages):
                    hint = " (a system message needs a user message after it)"
                raise ApiError(400, f"messages[{i}]: the model's chat template leaves this "
                                    f"{message['role']} message out{hint}", param=f"messages[{i}]")
        ids = self._encode(text, restore)
        if plan.forced:
            ids += self.tokenizer.encode(plan.syntax.start, add_special_tokens=False)
        return ids

    def _render(self, messages, tools, continue_final: bool, generation_prompt: bool,
                template_kwargs: dict) -> str:
        try:
            extra = {**template_kwargs, **({"tools": tools} if tools else {})}
            if continue_final:
                extra["continue_final_message"] = True
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False, **extra)
        except Exception as error:  # jinja's TemplateError (roles must alternate, ...), ValueError
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ApiError(400, f"messages: the chat template rejected them: {reason}",
                           param="messages") from None

    def _defused(self, data):
        """`data` with each control token's text in its strings (keys too) swapped for a
        sentinel character that no string holds, and the `str.translate` table that puts
        them back."""
        strings = list(_strings(data))
        forged = sorted({s[a:b] for s in strings for a, b in self.controls.spans(s)})
        if not forged:
            return (*data, {})
        free = (chr(c) for c in range(SENTINELS, 0x10FFFE) if not any(chr(c) in s for s in strings))
        sentinel = dict(zip(forged, free))

        def swap(s: str) -> str:
            out, at = [], 0
            for a, b in self.controls.spans(s):
                out += [s[at:a], sentinel[s[a:b]]]
                at = b
            return "".join(out) + s[at:]

        return (*_map_strings(data, swap), {ord(c): text for text, c in sentinel.items()})

    def _encode(self, text: str, restore: dict[int, str]) -> list[int]:
        """`text`'s ids; where sentinels stand for client text, that text is encoded plain
        and only the template's control tokens are read as such."""
        if not restore:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids, at = [], 0
        for a, b in [*self.controls.spans(text), (len(text), len(text))]:
            if a > at:
                ids += self.tokenizer.encode(text[at:a].translate(restore), add_special_tokens=False,
                                             split_special_tokens=True)
            if b > a:
                ids.append(self.controls.ids[text[a:b]])
            at = b
        return ids


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def _map_strings(value, fn):
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value
