"""Shared by several test modules; moved from test_vision.py."""

import numpy as np
from PIL import Image

QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]


def random_image(seed: int, size=(40, 52)) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


def image_prompt(target, image):
    ids = list(target.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True))
    return target.vision.prompter.prompt(ids, [image])


TOKENS = 32

def greedy(engine, prompt, gamma=0, cache=None, stats=None, max_tokens=TOKENS):
    return [t for r in engine.rounds(prompt.ids, gamma=gamma, max_tokens=max_tokens, images=prompt,
                                     prompt_cache=cache, stats=stats) for t in r.tokens]


