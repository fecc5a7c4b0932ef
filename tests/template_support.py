"""Shared by several test modules; moved from test_server_google_templates.py."""

import hashlib
from pathlib import Path

import pytest


def template_text(name: str) -> str:
    if name == "native":
        return NATIVE_TEMPLATE
    path = TEMPLATES / GOOGLE[name]
    if not path.exists():
        pytest.skip(f"{path} is not here (tests/data/templates/README.md says where it comes from)")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256[name], f"{path} is not the published file"
    return path.read_text()


TEMPLATES = Path(__file__).parent / "data" / "templates"


# Gemma 4's native tool form, written by us after Google's: calls, then their answers, in the
# model's turn; the turn stays open after answers with no text, so the model goes on in it.
NATIVE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools -%}{{ '<|turn>system\\n' }}{%- for tool in tools -%}"
    "{{ '<|tool>declaration:' + tool.function.name + '<tool|>' }}{%- endfor -%}{{ '<turn|>\\n' }}{%- endif -%}"
    "{%- set ns = namespace(open=false) -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{ '<|tool_call>call:' + call.function.name + (call.function.arguments | tojson) + '<tool_call|>' }}"
    "{%- endfor -%}"
    "{%- for answer in message.tool_responses or [] -%}"
    "{{ '<|tool_response>response:' + answer.name + (answer.response | tojson) + '<tool_response|>' }}"
    "{%- endfor -%}"
    "{{ message.content | trim }}"
    "{%- set ns.open = message.tool_responses and not message.content -%}"
    "{%- if not ns.open -%}{{ '<turn|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and not ns.open -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)


GOOGLE = {"gemma4": "gemma4.jinja", "gemma4-interleaved": "google-gemma-4-31B-it-interleaved.jinja"}


SHA256 = {  # the published files, byte for byte (tests/data/templates/README.md)
    "gemma4": "944e74c5fb3a9ae02bb1f93251ae749b2266b69cfacc1257534f9b57b3efbf11",
    "gemma4-interleaved": "749e841c23b6c9463622b44a1bbe1f6bc5299ffba0f306d5c785799b29c6ce37"}
