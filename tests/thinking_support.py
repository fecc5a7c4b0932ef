"""A model that thinks, for the thinking tests (issue 30, item 2): `ThinkingModel`, a
`ScriptedModel` that writes `<|channel>thought\n` THOUGHT `<channel|>` ANSWER `<turn|>`
after the model's opener and, when an end marker stands in its answer where it did not
write one (a forced one), goes on with ANSWER after it; a tokenizer with Gemma 4's
`<|channel>` and `<channel|>` as special tokens (mlx-lm infers the thought markers from
them); `THINKING_TEMPLATE`, Gemma 4's format with its thinking switch as Google's template
writes it, and Google's own template where tests/data/templates/gemma4.jinja holds it;
`reference`: the prompt as transformers renders it and mlx-lm's greedy answer, split by
`str.partition`.
"""

from pathlib import Path

from mlx_lm.utils import load_tokenizer
from scripted_model import (
    END_OF_TURN_ID,
    EOS_ID,
    OPENER,
    SPECIAL_TOKENS,
    TURN_ID,
    ScriptedModel,
    save_tokenizer,
)

from mlx_spec.core.engine import Engine

MODEL = "thinker"
START, END = "<|channel>thought\n", "<channel|>"
THOUGHT = "Two and two: two, two, two and two make four, two and two make four."
ANSWER = "The answer is 4."
ASK = [{"role": "user", "content": "What is 2+2?"}]
GOOGLE_TEMPLATE = Path(__file__).parent / "data" / "templates" / "gemma4.jinja"

# Gemma 4's turn format with its thinking switch as Google's template has it: <|think|> at
# the top of a system turn when enable_thinking is on, an empty thought channel after the
# model's opener when it is off, and earlier thoughts stripped from model turns.
THINKING_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- set loop_messages = messages -%}"
    "{%- if thinking or messages[0].role == 'system' -%}{{ '<|turn>system\\n' }}"
    "{%- if thinking -%}{{ '<|think|>' }}{%- endif -%}"
    "{%- if messages[0].role == 'system' -%}{{ messages[0].content | trim }}"
    "{%- set loop_messages = messages[1:] -%}{%- endif -%}{{ '<turn|>\\n' }}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
    "{{ '<|turn>' + role + '\\n' }}"
    "{%- if role == 'model' and '<channel|>' in message.content -%}"
    "{{ message.content.split('<channel|>')[-1] | trim }}"
    "{%- else -%}{{ message.content | trim }}{%- endif -%}"
    "{{ '<turn|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}"
    "{%- if not thinking -%}{{ '<|channel>thought\\n<channel|>' }}{%- endif -%}{%- endif -%}"
)
TEMPLATES = {"ours": THINKING_TEMPLATE}
if GOOGLE_TEMPLATE.exists():  # added with issue 30's item 1
    TEMPLATES["google"] = GOOGLE_TEMPLATE.read_text()


class ThinkingModel(ScriptedModel):
    """Writes `thought` (markers included) then `answer`; after an end marker that it did
    not write where the script has it (the server forced it), it writes `answer`."""

    def __init__(self, thought: list[int], end: int, answer: list[int]):
        super().__init__()
        self.thought, self.end, self.answer_ids = thought, end, answer

    def answer(self, history: list[int]) -> list[int]:
        out, start = [], None  # start: where the answer begins, after the model's opener
        for p, token in enumerate(history):
            if token == TURN_ID:
                start = p + OPENER + 1
            written = history[start:p + 1] if start is not None and p + 1 >= start else None
            if written is None:
                out.append(END_OF_TURN_ID)
            elif self.end in written:  # the thought is closed: the answer, then <turn|>
                after = len(written) - 1 - written.index(self.end)
                out.append((self.answer_ids + [END_OF_TURN_ID])[min(after, len(self.answer_ids))])
            else:
                out.append((self.thought + [self.end])[min(len(written), len(self.thought))])
        return out


def tokenizer_for(path: Path, template: str):
    save_tokenizer(path, template, SPECIAL_TOKENS + ["<|channel>", "<channel|>", "<|think|>"])
    return load_tokenizer(path, eos_token_ids=[EOS_ID, END_OF_TURN_ID])


def thinking_engine(tokenizer, drafter=None) -> Engine:
    encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    model = ThinkingModel(encode(START + THOUGHT), encode(END)[0], encode(ANSWER))
    return Engine(model, drafter, eos_ids=[EOS_ID, END_OF_TURN_ID], context_length=4096)


def reference(tokenizer, model, messages, enable_thinking: bool) -> tuple[list[int], str, str]:
    """(prompt ids as transformers renders them, thought, answer) from mlx-lm's greedy
    decoding of that prompt, split at the markers."""
    from mlx_lm import stream_generate
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer._tokenizer.name_or_path)
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                                 tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text = "".join(r.text for r in stream_generate(model, tokenizer, ids, max_tokens=200))
    before, marker, after = text.partition(START)
    if not marker:
        return ids, "", text
    thought, _, answer = after.partition(END)
    return ids, thought, before + answer
