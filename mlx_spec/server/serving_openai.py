"""OpenAI's `/v1/chat/completions` and `/v1/completions`: one serving class, as the two differ
only in how the prompt is made (a conversation through the chat template, or text or ids)
and in the shape of their answers (`openai_responses`: a message or text, a delta or text
chunk), whole or streamed as Server-Sent Events."""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from mlx_spec.models.vision import ImagePrompt
from mlx_spec.server.api_error import ApiError
from mlx_spec.server.jobs import Done, Failed, Job, Piece
from mlx_spec.server.logprobs import AnswerBytes, logprobs_object
from mlx_spec.server.openai_requests import ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from mlx_spec.server.openai_responses import (
    chunk_object,
    completion_object,
    new_id,
    sse,
    usage,
    usage_chunk,
)
from mlx_spec.server.request_base import parse_body
from mlx_spec.server.serving import SSE_HEADERS, CheckedRequest, Conversation, Serving, token_counts
from mlx_spec.server.tools import Call, CallSplitter, ToolPlan, openai_call, openai_plan, template_messages


class OpenAIServing(Serving):
    """OpenAI's chat completions and completions routes."""

    def add_routes(self, app: FastAPI) -> None:
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        app.get("/tokenizer_info")(self.tokenizer_info)

    async def tokenizer_info(self):
        """vLLM's `/tokenizer_info`, which lm-eval's remote tokenizer reads first: the special
        tokens' texts, the chat template and the context."""
        tokenizer = self.model.tokenizer
        return {"tokenizer_class": type(getattr(tokenizer, "_tokenizer", tokenizer)).__name__,
                **{name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")},
                "chat_template": getattr(tokenizer, "chat_template", None),
                "model_max_length": self.options.context_length}

    async def tokenize(self, request: Request):
        """Ids of a text (or of a chat through the template), in vLLM's shape (`tokens`,
        `count`, `max_model_len`) and llama.cpp's (`tokens`; with `with_pieces` each as
        `{"id", "piece"}`)."""
        body = await self.parsed(request, parse_body, TokenizeRequest)
        text = body.text()
        if text is None:
            messages = template_messages(body.messages, self.model.tool_syntax)
            conversation = Conversation(messages, generation_prompt=body.add_generation_prompt is not False)
            ids, _ = await self.chat_ids(conversation, ToolPlan(), queued=False)
        else:
            self.check_length(len(text), "prompt")
            encode = functools.partial(self.model.tokenizer.encode, add_special_tokens=body.special_tokens())
            ids = list(await self.tokenizing.run(encode, text, queued=False))
        tokens = ([{"id": t, "piece": self.model.tokenizer.decode([t])} for t in ids] if body.with_pieces
                  else ids)
        return {"tokens": tokens, "count": len(ids), "max_model_len": self.options.context_length}

    async def detokenize(self, request: Request):
        """The text of ids, as vLLM's (`prompt`) and llama.cpp's (`content`) answer it."""
        body = await self.parsed(request, parse_body, DetokenizeRequest)
        if any(not 0 <= t < self.model.vocab_size for t in body.tokens):
            raise ApiError(400, f"tokens: token ids must be in [0, {self.model.vocab_size})", param="tokens")
        text = await self.tokenizing.run(self.model.tokenizer.decode, body.tokens, queued=False)
        return {"prompt": text, "content": text}

    async def chat_completions(self, request: Request):
        checked, conversation = await self.parsed(request, self._read_chat)
        checked = await self.compiled(checked)
        ids, images = await self.chat_ids(conversation, checked.plan)
        return await self._answer(request, checked, ids, chat=True, images=images)

    def _read_chat(self, raw: bytes) -> tuple[CheckedRequest, Conversation]:
        body = parse_body(raw, ChatRequest)
        checked = self.validate(body)
        plan = openai_plan(body, self.model.tool_syntax)
        kwargs = body.template_kwargs()
        messages = template_messages(body.messages, self.model.tool_syntax)
        continue_final, generation_prompt = body.prompt_mode()
        wanted = self.output_grammar(body, plan, kwargs)
        return (replace(checked, plan=plan, wanted=wanted),
                Conversation(messages, continue_final, generation_prompt, kwargs))

    async def completions(self, request: Request):
        checked = await self.compiled(await self.parsed(request, self._read_completion))
        prompt = checked.body.single_prompt()
        if isinstance(prompt, str):
            self.check_length(len(prompt), "prompt")
            ids = list(await self.tokenizing.run(self.model.tokenizer.encode, prompt))
        else:
            ids = list(prompt)
            if any(not 0 <= t < self.model.vocab_size for t in ids):
                raise ApiError(400, f"prompt: token ids must be in [0, {self.model.vocab_size})",
                               param="prompt")
        return await self._answer(request, checked, ids, chat=False)

    def _read_completion(self, raw: bytes) -> CheckedRequest:
        body = parse_body(raw, CompletionRequest)
        checked = self.validate(body)
        body.check_echo()
        return replace(checked, wanted=self.output_grammar(body))

    async def _answer(self, request: Request, checked: CheckedRequest, prompt_ids: list[int],
                      chat: bool, images: Optional[ImagePrompt] = None):
        """The generation's answer, whole or (`stream`) as a stream of chunks."""
        body = checked.body
        echo = not chat and bool(body.echo)
        job = self.submit(checked, prompt_ids, "messages" if chat else "prompt", images=images,
                          score_prompt=echo and checked.logprobs is not None, sender=request)
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._stream(job, chat, rid, include_usage, self.splitter(checked)),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        pieces, event = await self.collect(job, request)
        splitter = self.splitter(checked)
        parts = splitter.feed("".join(p.text for p in pieces)) + splitter.finish()
        text = "".join(p for p in parts if isinstance(p, str))
        calls = [openai_call(c) for c in parts if isinstance(c, Call)]
        scored = [lp for p in pieces for lp in p.logprobs]
        if echo:  # the prompt before the answer, as sent (ids as their text), its log-probs first
            prompt = body.single_prompt()
            text = (prompt if isinstance(prompt, str) else self.model.tokenizer.decode(prompt)) + text
            scored = [lp for p in pieces for lp in p.prompt_logprobs or []] + scored
        answer = completion_object(chat, rid, self.options.model_name, text,
                                   "tool_calls" if calls and event.finish_reason == "stop" else event.finish_reason,
                                   usage_of(job, event), self.extra(event),
                                   reasoning="".join(p.reasoning for p in pieces))
        if job.logprobs is not None:
            answer["choices"][0]["logprobs"] = logprobs_object(chat, scored, self.model.describe,
                                                               AnswerBytes(self.model.trims_first_space and not echo,
                                                                           job.skip_ids))
        if calls:
            answer["choices"][0]["message"].update(content=text or None, tool_calls=calls)
        return answer

    async def _stream(self, job: Job, chat: bool, rid: str, include_usage: bool, splitter: CallSplitter):
        created = int(time.time())
        name = self.options.model_name
        calls, answer = 0, AnswerBytes(self.model.trims_first_space, job.skip_ids)

        def pieces(parts: list, scored: list, reasoning: str = ""):
            nonlocal calls
            text = "".join(p for p in parts if isinstance(p, str))
            if text or scored or reasoning:
                chunk = chunk_object(chat, rid, name, created, text=text if text or not reasoning else None,
                                     reasoning=reasoning)
                if job.logprobs is not None:
                    chunk["choices"][0]["logprobs"] = logprobs_object(chat, scored, self.model.describe, answer)
                yield sse(chunk)
            for call in (p for p in parts if isinstance(p, Call)):
                chunk = chunk_object(chat, rid, name, created)
                chunk["choices"][0]["delta"]["tool_calls"] = [openai_call(call, calls)]
                calls += 1
                yield sse(chunk)

        try:
            if chat:
                yield sse(chunk_object(chat, rid, name, created, text="", role=True))
            while True:
                event = await job.events.get()
                if isinstance(event, Piece):
                    for out in pieces(splitter.feed(event.text), event.logprobs, event.reasoning):
                        yield out
                elif isinstance(event, Failed):
                    yield sse(ApiError(event.status, event.message, type="server_error").body())
                    break
                else:  # the finish chunk carries the statistics, usage or not
                    for out in pieces(splitter.finish(), []):
                        yield out
                    finish = event.finish_reason
                    last = chunk_object(chat, rid, name, created,
                                        finish="tool_calls" if calls and finish == "stop" else finish)
                    yield sse({**last, "mlx_spec": self.extra(event)})
                    if include_usage:
                        yield sse(usage_chunk(chat, rid, name, created, usage_of(job, event),
                                              self.extra(event)))
                    break
            yield sse("[DONE]")
        finally:
            # Reached when the answer is complete and when Starlette cancels this generator
            # because the client disconnected: either way the worker may stop the job.
            self.worker.cancel(job)


def usage_of(job: Job, done: Done) -> dict:
    return usage(*token_counts(job, done))
