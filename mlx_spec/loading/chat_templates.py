"""Chat templates for checkpoints that ship without one.

GGUF files of base models (such as the embedded Gemma 3 270M) carry no template, yet the
Gemma family was trained on one turn format; `--chat` falls back to it. `--chat-template`
names one of `BUILT_IN` or a .jinja file (`chat_template_text`); the default preset chats in
"qa", the plain question-and-answer text its base model copes with.
"""

from pathlib import Path

from mlx_spec.errors import UsageError

# Gemma 3 turn format: an optional system message is folded into the first user turn,
# roles alternate, the assistant is called "model"; a content list's image parts render as
# <start_of_image> (the processor expands it), its text parts trimmed, as Google's does.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\n' }}"
    "{%- endif -%}"
)

# Gemma 4 turn format: turns open with <|turn>role and close with <turn|>; a system turn
# is its own turn (Gemma 4 has the role); the assistant is called "model"; a content list's
# image parts render as \n\n<|image|>\n\n (the processor expands it), its text parts
# trimmed, as Google's does.
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<|turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '\n\n<|image|>\n\n' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<turn|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|turn>model\n' }}"
    "{%- endif -%}"
)

# Questions and answers as plain text, for a base model that never saw a turn format: the
# embedded Gemma 3 270M echoes a Gemma turn back with junk ("… mendatang"), but continues
# "Question: …\nAnswer:" with an answer. An optional system message is a first paragraph.
# It asks for no control tokens, so the answer ends where the model starts the next
# question (`TEMPLATE_STOPS`).
QA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] | trim }}{{ '\n\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'Question: ' + message['content'] | trim }}{{ '\n' }}"
    "{%- else -%}{{ 'Answer: ' + message['content'] | trim }}{{ '\n\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Answer:' }}{%- endif -%}"
)

BUILT_IN = {"gemma3": GEMMA_CHAT_TEMPLATE, "gemma4": GEMMA4_CHAT_TEMPLATE, "qa": QA_CHAT_TEMPLATE}
# Stop strings a built-in template needs: where its answer ends in plain text.
TEMPLATE_STOPS = {"qa": ("\nQuestion:",)}


def chat_template_text(value: str) -> str:
    """The template `--chat-template` names: a built-in one by name, else a file's text."""
    if value in BUILT_IN:
        return BUILT_IN[value]
    path = Path(value).expanduser()
    if not path.is_file():
        raise UsageError(f"--chat-template {value!r}: no such file, and no built-in template of that "
                         f"name ({', '.join(BUILT_IN)})")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--chat-template {value!r}: cannot read it ({error})") from None
