"""A scripted stand-in for a target model, for tests that need a known answer (a tool call)
from a real server: its greedy output after the chat template's `<|turn>model\n` opener is
`script`, token by token, then <turn|>. A prompt that goes on past the opener (a forced call's
start marker) is continued as a model would: the script follows it, it is not restarted.
Everything else on the path (mlx-lm's tokenizer and template, the engine, its caches and
rollback, the HTTP server) is the real one.

The model keeps the token ids it has seen in a plain mlx-lm `KVCache` (as keys [1, 1, L, 1]),
so the engine's prefix reuse and rollback work on it exactly as on a transformer.
"""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlx_spec.testing.tiny import byte_tokenizer_json

# Gemma 4's turn tokens and tool-call markers (the real checkpoints have them as special tokens).
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|tool_call>",
                  "<tool_call|>", "<|tool>", "<tool|>", "<|tool_response>", "<tool_response|>", '<|"|>']
# With the thinking channel's markers too, which Google's own template writes (VOCAB is full).
GOOGLE_SPECIAL_TOKENS = SPECIAL_TOKENS + ["<|channel>", "<channel|>", "<|think|>"]
TURN_ID, END_OF_TURN_ID, EOS_ID = 4, 5, 1
VOCAB = 272

# A Gemma-4-shaped template with tools: declarations in a system turn, an assistant's calls as
# <|tool_call>call:name{...}<tool_call|>, tool answers as <|tool_response> in a tool turn.
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools -%}{{ '<|turn>system\\n' }}"
    "{%- for tool in tools -%}{{ '<|tool>declaration:' + tool.function.name }}"
    "{{ tool.function | tojson }}{{ '<tool|>' }}{%- endfor -%}{{ '<turn|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'tool' -%}"
    "{{ '<|turn>tool\\n<|tool_response>response:' + message.name + '{value:<|\"|>' + message.content"
    " + '<|\"|>}<tool_response|><turn|>\\n' }}"
    "{%- else -%}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
    "{{ '<|turn>' + role + '\\n' + (message.content or '') | trim }}"
    "{%- for call in message.tool_calls or [] -%}{{ '<|tool_call>call:' + call.function.name }}"
    "{{ call.function.arguments | tojson }}{{ '<tool_call|>' }}{%- endfor -%}{{ '<turn|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)
OPENER = len("model\n")  # tokens after <|turn> before the answer


class ScriptedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.script: list[int] = []
        self.seen: list[int] = []  # every id held after the latest call (the prompt, then some)
        self.layers = [None]

    def make_cache(self):
        return [KVCache()]

    def __call__(self, inputs, cache=None):
        ids = inputs.astype(mx.float32)[:, None, :, None]
        keys, _ = cache[0].update_and_fetch(ids, ids)
        history = [int(v) for v in keys[0, 0, :, 0].tolist()]
        self.seen = history
        rows = self.answer(history)[len(history) - inputs.shape[1]:]
        return 30.0 * mx.eye(VOCAB)[mx.array(rows)][None]

    def answer(self, history: list[int]) -> list[int]:
        """The token the model writes after each position of `history`."""
        out, turn, written = [], None, 0  # written: script tokens the answer holds so far
        for p, token in enumerate(history):
            if token == TURN_ID:
                turn, written = p, 0
            elif turn is not None and p > turn + OPENER and written < len(self.script):
                # The script's next token (the model's own, or the prompt's saying the same)
                # advances the answer; any other is prompt, which the script follows.
                written = written + 1 if token == self.script[written] else 0
            answering = turn is not None and p >= turn + OPENER and written < len(self.script)
            out.append(self.script[written] if answering else END_OF_TURN_ID)
        return out


def save_tokenizer(path: Path, chat_template: str = TOOL_TEMPLATE, special_tokens=SPECIAL_TOKENS) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(byte_tokenizer_json(special_tokens)))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": chat_template}))
    return path


class InProcessServer:
    """`create_app` on uvicorn in a thread of this process (so a test can set the script)."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.05)

    def client(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base, api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                      timeout=60, **kwargs)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
