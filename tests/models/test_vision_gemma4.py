"""Gemma 4 images with drafting kept, on tiny random Gemma 4 vision checkpoints built with
mlx-vlm's own classes (`mlx_spec.testing.tiny_vision.save_tiny_gemma4_vision`):

- "e2b": as E2B / E4B: per-layer inputs, KV-shared layers, causal attention over images;
- "31b": as 12B / 26B / 31B: no per-layer inputs, no KV sharing, and
  `use_bidirectional_attention: "vision"`: in the prefill an image's tokens see each other
  both ways on the sliding-window layers, while the full-attention layers stay causal
  (transformers' `create_masks_for_vision_model` and Google's reference). mlx-vlm 0.7.10 opens
  the full-attention layers too, so there the reference is mlx-vlm's own generate with its
  masks built by transformers' rule.

The greedy answer equals mlx-vlm's generate with no drafter, with n-gram lookup and with the
MTP assistant (text-only: it reads the target's K/V); images of different sizes get
different token counts and answers; caches never reuse one image's positions for another.
"""

import numpy as np
import pytest
from cli_support import assert_usage_error, invoke, invoke_json
from PIL import Image
from vision_support import QUESTION, image_prompt
from vision_support import greedy as greedy_for

from mlx_spec.cache.sequence import PromptCache
from mlx_spec.core.engine import Engine
from mlx_spec.core.stats import Stats
from mlx_spec.drafters.mtp import MtpDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.loading.pairing import load_pair
from mlx_spec.testing.tiny_gemma4 import save_tiny_assistant, tiny_assistant_config
from mlx_spec.testing.tiny_vision import save_tiny_gemma4_vision

pytest_plugins = ["cli_fixtures"]  # fixtures: private_cost_cache
# mlx-vlm's Gemma 4 processor (the reference's) builds an audio feature extractor transformers warns about
pytestmark = pytest.mark.filterwarnings("ignore:At least one mel filter has all zero values")

TOKENS = 24
SIZES = {"a": (40, 52), "b": (40, 40)}  # 6 and 9 soft tokens
# As 12B and up: no per-layer inputs, no KV-shared layers, a full layer between sliding ones.
BIG = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0)
CHECKPOINTS = {"e2b": {}, "31b": dict(bidirectional=True, **BIG)}


def random_image(name: str) -> Image.Image:
    size = SIZES[name]
    return Image.fromarray((np.random.default_rng(ord(name)).random((*size, 3)) * 255).astype("uint8"))


def save_pair(root, **checkpoint):
    """A tiny Gemma 4 vision target in root/target and its MTP assistant in root/assistant."""
    import json

    target = save_tiny_gemma4_vision(root / "target", **checkpoint)
    text_config = json.loads((target / "config.json").read_text())["text_config"]
    save_tiny_assistant(root / "assistant", tiny_assistant_config(text_config))
    return target, root / "assistant"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each checkpoint's (target folder, assistant folder)."""
    return {name: save_pair(tmp_path_factory.mktemp(f"gemma4-vision-{name}"), **checkpoint)
            for name, checkpoint in CHECKPOINTS.items()}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def pair(request, folders):
    """(checkpoint name, its folder, the target loaded with the MTP assistant as draft)."""
    target, assistant = folders[request.param]
    return request.param, target, load_pair(str(target), str(assistant), dtype="float32", progress=False)


def greedy(engine, prompt, gamma=0, cache=None, stats=None):
    return greedy_for(engine, prompt, gamma, cache, stats, max_tokens=TOKENS)


def engine_for(pair, drafter=None):
    target = pair.target
    drafter = MtpDrafter(pair.draft.model, target.model) if drafter == "mtp" else drafter
    return Engine(target.model, drafter, eos_ids=target.tokenizer.eos_token_ids, vision=target.vision)


def transformers_masks(text_model, h, cache, mm_token_type_ids=None):
    """mlx-vlm's `_make_masks` with transformers' rule (`create_masks_for_vision_model`):
    full-attention layers causal; sliding ones (causal OR same image) AND the window."""
    from mlx_lm.models.base import create_causal_mask

    N = h.shape[1]
    if mm_token_type_ids is None or N == 1:
        return type(text_model)._make_masks(text_model, h, cache, None)
    blocks = text_model._block_sequence_ids_for_mask(mm_token_type_ids)[0]
    same = (blocks[:, None] == blocks[None, :]) & (blocks[:, None] >= 0)
    rows = mx_arange(N)
    window = text_model.window_size
    sliding = (create_causal_mask(N) | same) & (rows[:, None] - rows[None, :] < window)
    return [sliding if layer.layer_type == "sliding_attention" else create_causal_mask(N)
            for layer in text_model.layers]


def mx_arange(n):
    import mlx.core as mx

    return mx.arange(n)


@pytest.fixture(scope="module")
def vlm(pair):
    """mlx-vlm's own model and processor of the folder (its own Gemma 4 language model);
    on "31b", with its masks built by transformers' rule (see the module docstring)."""
    from mlx_vlm.utils import load

    name, folder, _ = pair
    model, processor = load(folder)
    text_model = model.language_model.model
    if name == "31b":
        text_model._make_masks = lambda h, cache, types=None: transformers_masks(text_model, h, cache, types)
    return model, processor


def vlm_inputs(processor, image: str) -> dict:
    from mlx_vlm.utils import prepare_inputs

    text = processor.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return prepare_inputs(processor, images=[random_image(image)], prompts=text.removeprefix("<bos>"))


@pytest.fixture(scope="module")
def reference(pair, vlm):
    """For each image: mlx-vlm's processor's ids, and its generate_step's greedy tokens,
    fed the processor's `mm_token_type_ids` as mlx-vlm's generate feeds them."""
    from mlx_vlm.generate import generate_step

    model, processor = vlm
    answers = {}
    for image in SIZES:
        inputs = vlm_inputs(processor, image)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        tokens = []
        for token, _ in generate_step(inputs["input_ids"], model, inputs["pixel_values"], inputs["attention_mask"],
                                      max_tokens=TOKENS, temperature=0.0, **extra):
            tokens.append(int(token))
            if tokens[-1] in pair[2].target.tokenizer.eos_token_ids:
                break
        answers[image] = (inputs["input_ids"][0].tolist(), tokens)
    return answers


@pytest.mark.parametrize("drafter", [None, "ngram", "mtp"])
def test_image_answer_equals_mlx_vlm_generate(pair, reference, drafter, record_property):
    loaded = pair[2]
    engine = engine_for(loaded, NgramDrafter() if drafter == "ngram" else drafter)
    stats = Stats()
    for image, (reference_ids, reference_tokens) in reference.items():
        prompt = image_prompt(loaded.target, random_image(image))
        assert prompt.ids == reference_ids
        assert greedy(engine, prompt, gamma=3 if drafter else 0, stats=stats) == reference_tokens
    if drafter:
        assert stats.drafted > 0
        record_property("acceptance_rate", stats.accepted / stats.drafted)


def test_images_get_their_own_token_counts_and_answers(pair, reference):
    target = pair[2].target
    a, b = (image_prompt(target, random_image(name)) for name in "ab")
    image_id = target.vision.prompter.image_id
    assert (a.ids.count(image_id), b.ids.count(image_id)) == (6, 9)
    assert reference["a"][1] != reference["b"][1]
    # the image's features matter: its ids without them answer otherwise
    assert [t for r in Engine(target.model).rounds(a.ids, gamma=0, max_tokens=TOKENS) for t in r.tokens] \
        != reference["a"][1]


def test_a_cache_never_reuses_another_images_positions(pair):
    """After image a, an image of the same size but other pixels shares the placeholder ids:
    the cache is reused only up to its first image token, and it answers as a fresh cache."""
    loaded = pair[2]
    engine = engine_for(loaded, "mtp")
    a = image_prompt(loaded.target, random_image("a"))
    other = image_prompt(loaded.target, Image.fromarray(np.asarray(random_image("a"))[::-1].copy()))
    assert a.ids == other.ids
    cache = PromptCache(loaded.target.model, slack=engine.max_gamma + 1)
    greedy(engine, a, gamma=3, cache=cache)
    stats = Stats()
    assert greedy(engine, other, gamma=3, cache=cache, stats=stats) == greedy(engine_for(loaded), other)
    first_image_token = next(i for i, key in enumerate(other.keys) if isinstance(key, tuple))
    assert stats.prefill_tokens == len(other.ids) - 1 - first_image_token


def test_a_chats_second_image_turn(pair):
    """A chat (`chat`'s `/image`) with image a in turn 1 and image b in turn 2, drafting with
    the assistant: turn 2 prefills only its new tokens and answers as plain decoding of the
    same image prompt from a fresh cache."""
    from mlx_spec.apps.conversation import ChatSession
    from mlx_spec.core.sampling import SamplingParams

    loaded = pair[2]
    engine = engine_for(loaded, "mtp")
    prompts = []  # the ImagePrompt of each turn, as the engine is given it
    run = engine.run
    engine.run = lambda request, **kwargs: prompts.append(request.images) or run(request, **kwargs)
    session = ChatSession(engine, loaded.target.tokenizer)

    def turn(images):
        stats = Stats()
        tokens = [t for r in session.ask("What is this?", SamplingParams(), [random_image(i) for i in images],
                                         gamma=3, max_tokens=TOKENS, stats=stats) for t in r.tokens]
        return tokens, stats

    turn("a")
    second, stats = turn("b")
    first, prompt = prompts
    assert prompt.ids[:len(first.ids)] == first.ids
    assert prompt.ids.count(loaded.target.vision.prompter.image_id) == 6 + 9
    assert stats.prefill_tokens < len(prompt.ids) - len(first.ids)
    assert second == [t for r in engine_for(loaded).rounds(prompt.ids, gamma=0, max_tokens=TOKENS, images=prompt)
                      for t in r.tokens]


def test_a_gemma4_checkpoint_without_a_vision_tower_refuses_images(tmp_path, private_cost_cache):
    from mlx_spec.testing.tiny_gemma4 import save_tiny_gemma4

    target = save_tiny_gemma4(tmp_path / "text-only")
    random_image("a").save(tmp_path / "a.png")
    result = invoke(["generate", "Hello", "--model", str(target), "--image", str(tmp_path / "a.png"),
                     "--max-tokens", "4"])
    assert_usage_error(result, "--image", "reads no images (it has no vision tower)")


def test_prefill_logits_equal_the_reference(pair, vlm):
    """The logits after the image prompt's prefill equal the reference forward's; on "31b"
    they differ from mlx-vlm's own masks, which open the full-attention layers to the image
    too (so the rule is what this checks, not only the greedy answers above)."""
    import mlx.core as mx

    name, _, loaded = pair
    model, processor = vlm
    inputs = vlm_inputs(processor, "a")
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}

    def last_logits():
        return model(inputs["input_ids"], inputs["pixel_values"], cache=model.language_model.make_cache(),
                     **extra).logits[0, -1]

    prompt = image_prompt(loaded.target, random_image("a"))
    cache = PromptCache(loaded.target.model, slack=4).target
    cache.prefill(prompt.ids[:-1], keys=prompt.keys,
                  inputs=lambda begin, end: loaded.target.vision.embed(prompt, begin, end))
    ours = cache.forward(mx.array(prompt.ids[-1:]))[-1]
    assert mx.abs(ours - last_logits()).max().item() < 1e-4
    if name == "31b":
        text_model = model.language_model.model
        patched = text_model._make_masks
        del text_model._make_masks  # mlx-vlm's own
        try:
            assert mx.abs(ours - last_logits()).max().item() > 1e-3
        finally:
            text_model._make_masks = patched


@pytest.fixture(scope="module", params=["built-in", "gemma4"])
def served(request, tmp_path_factory):
    """(server, loaded pair) on the "e2b" checkpoint with the MTP assistant as draft, its
    chat template ours or Google's own (tests/data/templates/README.md; skipped without it)."""
    from scripted_model import InProcessServer
    from template_support import template_text

    from mlx_spec.server import ServerOptions, create_app

    template = None if request.param == "built-in" else template_text(request.param)
    target, assistant = save_pair(tmp_path_factory.mktemp(f"served-gemma4-vision-{request.param}"),
                                  chat_template=template)
    loaded = load_pair(str(target), str(assistant), dtype="float32", progress=False)
    server = InProcessServer(create_app(engine_for(loaded, "mtp"), loaded.target.tokenizer,
                                        ServerOptions(model_name="tiny", gamma="3", parallel=4)))  # as serve
    yield server, loaded
    server.stop()


def plain_answer(loaded, image: str, thinking: bool):
    """Greedy decoding without drafting, in-process, of the question with `image` as the
    checkpoint's template renders it (transformers' rendering), thinking on or off."""
    from mlx_spec.apps.stream import generate

    tokenizer = loaded.target.tokenizer
    ids = list(tokenizer._tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=thinking,
                                                        tokenize=True, return_dict=False))
    prompt = loaded.target.vision.prompter.prompt(ids, [random_image(image)])
    return generate(engine_for(loaded), tokenizer, prompt.ids, gamma=0, max_tokens=TOKENS, images=prompt)


def test_the_server_answers_an_image_with_drafting(served):
    """The official openai client sends an image_url data URL: the answer drafts (acceptance
    reported) and equals plain decoding in-process of the prompt the template renders; the
    official anthropic client's image block gets the same answer."""
    import base64
    import io

    import anthropic

    server, loaded = served
    tokenizer = loaded.target.tokenizer
    answers = {}
    for name in "ab":
        buffer = io.BytesIO()
        random_image(name).save(buffer, format="PNG")
        data = base64.b64encode(buffer.getvalue()).decode()
        answer = server.client().chat.completions.create(model="tiny", max_tokens=TOKENS, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}},
                                         {"type": "text", "text": "What is this?"}]}])
        plain = plain_answer(loaded, name, thinking=tokenizer.has_thinking)  # the OpenAI route's default
        assert answer.usage.prompt_tokens == plain.prompt_tokens
        assert answer.choices[0].message.content == plain.text
        stats = answer.model_extra["mlx_spec"]
        assert stats["drafted"] > 0 and 0 <= stats["acceptance_rate"] <= 1
        answers[name] = plain.text
    assert answers["a"] != answers["b"]
    client = anthropic.Anthropic(base_url=server.base.removesuffix("/v1"), api_key="unused", max_retries=0)
    message = client.messages.create(model="tiny", max_tokens=TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
            {"type": "text", "text": "What is this?"}]}])
    # without `thinking`, Anthropic's route renders with thinking off
    assert "".join(block.text for block in message.content if block.type == "text") == \
        plain_answer(loaded, "b", thinking=False).text


def test_generate_with_an_image_and_the_assistant(folders, tmp_path, private_cost_cache):
    """`generate --image` on the bidirectional checkpoint, drafting with the MTP assistant:
    the same answer as without drafting, acceptance reported; raw, the image's placeholder
    comes before the text."""
    target, assistant = folders["31b"]
    random_image("a").save(tmp_path / "a.png")
    common = ["generate", "What is this?", "--model", str(target), "--image", str(tmp_path / "a.png"),
              "-n", str(TOKENS), "--temp", "0"]
    plain = invoke_json([*common, "--gamma", "0"])
    drafted = invoke_json([*common, "--draft-model", str(assistant), "--gamma", "3"])
    assert drafted["text"] == plain["text"] and drafted["stats"]["drafted"] > 0
    assert 0 <= drafted["stats"]["acceptance_rate"] <= 1
    raw = invoke_json([*common, "--gamma", "0", "--raw"])
    assert raw["prompt_tokens"] == 1 + (1 + 6 + 1) + len("What is this?")  # BOS, <|image> 6 x <|image|> <image|>
