"""Images with drafting kept, on a tiny random Gemma 3 vision checkpoint built with mlx-vlm's
own classes (`mlx_spec.testing.tiny_vision`): the image prompt's greedy answer equals
mlx-vlm's own generate on the same folder and image, and stays identical with every drafter;
two images give two answers; caches never reuse one image's positions for another; a model
without a vision tower refuses images in one line; bad images are refused in one line."""

import pytest
from cli_support import assert_usage_error, invoke, invoke_json
from vision_support import (  # noqa: F401
    QUESTION,
    TOKENS,  # noqa: F401
    greedy,
    image_prompt,
    random_image,
)

from mlx_spec.cache.sequence import PromptCache
from mlx_spec.core.engine import Engine
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.core.stats import Stats
from mlx_spec.drafters.model import ModelDrafter
from mlx_spec.drafters.ngram import NgramDrafter
from mlx_spec.errors import MlxSpecError
from mlx_spec.loading.loader import load_model
from mlx_spec.models import vision
from mlx_spec.testing.tiny import perturbed_copy
from mlx_spec.testing.tiny_vision import save_text_draft, save_tiny_gemma3_vision

pytest_plugins = ["cli_fixtures"]  # fixtures: tiny_dirs, private_cost_cache


@pytest.fixture(scope="module")
def vision_dirs(tmp_path_factory):
    """(target dir, text-only draft dir, image files a and b)."""
    root = tmp_path_factory.mktemp("vision")
    target = save_tiny_gemma3_vision(root / "target")
    draft = save_text_draft(root / "draft", target)
    files = []
    for seed, name in ((0, "a.png"), (1, "b.png")):
        random_image(seed).save(root / name)
        files.append(str(root / name))
    return str(target), str(draft), files


@pytest.fixture(scope="module")
def target(vision_dirs):
    return load_model(vision_dirs[0], progress=False)



def plain_engine(target):
    return Engine(target.model, eos_ids=target.tokenizer.eos_token_ids, vision=target.vision)


def test_image_answer_equals_mlx_vlm_generate(target, vision_dirs):
    """The independent reference: mlx-vlm loads the same folder whole (its own Gemma 3
    language model), its processor expands and tokenizes the rendered prompt, and its
    generate_step decodes greedily."""
    from pathlib import Path

    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import load, prepare_inputs

    model, processor = load(Path(vision_dirs[0]))
    image = random_image(0)
    text = processor.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    # mlx-vlm's processor adds the BOS itself
    inputs = prepare_inputs(processor, images=[image], prompts=text.removeprefix("<bos>"))
    reference = []
    for token, _ in generate_step(inputs["input_ids"], model, inputs["pixel_values"], inputs["attention_mask"],
                                  max_tokens=TOKENS, temperature=0.0):
        reference.append(int(token))
        if reference[-1] in target.tokenizer.eos_token_ids:
            break
    prompt = image_prompt(target, image)
    assert prompt.ids == inputs["input_ids"][0].tolist()
    assert greedy(plain_engine(target), prompt) == reference


@pytest.mark.parametrize("kind", ["ngram", "draft model"])
def test_drafting_keeps_the_image_answer(target, kind, record_property):
    prompt = image_prompt(target, random_image(0))
    plain = greedy(plain_engine(target), prompt)
    drafter = (NgramDrafter() if kind == "ngram" else
               ModelDrafter(perturbed_copy(target.model.language_model, noise=0.02), 272))
    engine = Engine(target.model, drafter, eos_ids=target.tokenizer.eos_token_ids, vision=target.vision)
    stats = Stats()
    assert greedy(engine, prompt, gamma=3, stats=stats) == plain
    assert stats.drafted > 0
    record_property("acceptance_rate", stats.accepted / stats.drafted)


def test_the_image_changes_the_answer(target):
    engine = plain_engine(target)
    a, b = (greedy(engine, image_prompt(target, random_image(seed))) for seed in (0, 1))
    assert a != b
    text_only = image_prompt(target, random_image(0)).ids  # the same ids, no features
    assert [t for r in Engine(target.model).rounds(text_only, gamma=0, max_tokens=TOKENS) for t in r.tokens] != a


def test_a_cache_never_reuses_another_images_positions(target):
    """After image a, a prompt with image b (same placeholder ids) reuses the cache only up
    to its first image token, and answers as a fresh cache does; image a again reuses all."""
    engine = plain_engine(target)
    a, b = image_prompt(target, random_image(0)), image_prompt(target, random_image(1))
    assert a.ids == b.ids
    cache = PromptCache(target.model, slack=engine.max_gamma + 1)
    greedy(engine, a, cache=cache)
    stats = Stats()
    assert greedy(engine, b, cache=cache, stats=stats) == greedy(engine, b)
    first_image_token = next(i for i, key in enumerate(b.keys) if isinstance(key, tuple))
    assert stats.prefill_tokens == len(b.ids) - 1 - first_image_token
    again = Stats()
    assert greedy(engine, b, cache=cache, stats=again) == greedy(engine, b)
    assert again.prefill_tokens == 0


def test_a_model_without_a_vision_tower_refuses_images(tiny_dirs, vision_dirs, private_cost_cache):
    target, _ = tiny_dirs
    result = invoke(["generate", "Hello", "--model", target, "--image", vision_dirs[2][0], "--max-tokens", "4"])
    assert_usage_error(result, "--image", "reads no images (it has no vision tower)")
    with pytest.raises(MlxSpecError, match="reads no images"):
        next(Engine(load_model(target, progress=False).model).rounds([2, 3], images=vision.ImagePrompt([2, 3], [2, 3], None)))


def test_generate_with_images_and_a_text_draft(vision_dirs, private_cost_cache):
    """`generate --image` (chat and raw), drafting with the text-only draft model: the same
    answer as without drafting, acceptance reported; two images need two placeholders."""
    target, draft, (a, b) = vision_dirs
    common = ["generate", "What is this?", "--model", target, "--image", a, "-n", str(TOKENS), "--temp", "0"]
    plain = invoke_json([*common, "--gamma", "0"])
    drafted = invoke_json([*common, "--draft-model", draft, "--gamma", "3"])
    assert drafted["text"] == plain["text"] and drafted["stats"]["drafted"] > 0
    assert 0 <= drafted["stats"]["acceptance_rate"] <= 1
    other = invoke_json([*common[:5], b, *common[6:], "--gamma", "0"])
    assert other["text"] != plain["text"]
    both = invoke_json([*common, "--image", b, "--gamma", "0", "--raw"])
    assert both["prompt_tokens"] == len("What is this?") + 1 + 2 * (4 + 2 + 4)  # BOS, \n\n boi 4×image eoi \n\n


@pytest.mark.parametrize("data, message", [
    (b"not an image", "not an image PIL can read"),
    (b"", "not an image PIL can read"),
])
def test_non_image_bytes_are_refused(data, message):
    with pytest.raises(vision.ImageError, match=message):
        vision.open_image(data, "image")


def test_image_limits_and_base64(monkeypatch):
    import base64
    import io

    buffer = io.BytesIO()
    random_image(0).save(buffer, format="PNG")
    encoded = base64.b64encode(buffer.getvalue()).decode()
    assert vision.image_from_url(f"data:image/png;base64,{encoded}", "x").size == (52, 40)
    with pytest.raises(vision.ImageError, match="not valid base64"):
        vision.decode_base64_image(encoded[:-3] + "!!!", "x")
    with pytest.raises(vision.ImageError, match="not fetched unless the server is started with --allow-image-urls"):
        vision.image_from_url("https://example.com/cat.png", "x")
    monkeypatch.setattr(vision, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(vision.ImageError, match="52x40 pixels, over the limit of 1,000 pixels"):
        vision.decode_base64_image(encoded, "x")
    monkeypatch.setattr(vision, "MAX_IMAGE_BYTES", 100)
    with pytest.raises(vision.ImageError, match="over the limit of 100"):
        vision.decode_base64_image(encoded, "x")


def test_a_chat_keeps_its_images_across_turns(target):
    """Turn 2 (text only) of a chat whose turn 1 had an image, drafting with n-gram lookup,
    equals plain decoding of its prompt from a fresh cache, with turn 1's image features,
    and prefills only its new tokens."""
    from mlx_spec.apps.conversation import ChatSession

    engine = Engine(target.model, NgramDrafter(), eos_ids=target.tokenizer.eos_token_ids, vision=target.vision)
    session = ChatSession(engine, target.tokenizer)
    image = random_image(0)

    def turn(content, images=()):
        stats = Stats()
        tokens = [t for r in session.ask(content, SamplingParams(), images, gamma=3, max_tokens=TOKENS,
                                         stats=stats) for t in r.tokens]
        return tokens, stats

    first = image_prompt(target, image)
    turn("What is this?", [image])
    assert session.prompt_ids == first.ids
    second, stats = turn("And now?")
    assert session.prompt_ids[:len(first.ids)] == first.ids
    assert session.prompt_ids.count(target.vision.prompter.image_id) == 4  # one image, not re-expanded
    assert second == greedy(plain_engine(target), first.extended(session.prompt_ids))
    assert stats.prefill_tokens < len(session.prompt_ids) - len(first.ids)


def test_chat_image_command(vision_dirs, tiny_dirs, private_cost_cache):
    target, _, (a, _) = vision_dirs
    result = invoke(["chat", "--model", target, "--drafter", "ngram", "-n", "8"],
                    input=f"/image {a}\n/image /no/such.png\nWhat is this?\n")
    assert result.exit_code == 0, result.stderr
    assert "1 image attached to your next message" in result.stdout
    assert "error: /image /no/such.png: no such file" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    plain = invoke(["chat", "--model", tiny_dirs[0], "-n", "4"], input=f"/image {a}\n")
    assert "error: this model reads no images (it has no vision tower)" in plain.stdout


def test_a_text_turn_after_an_image_runs_no_vision_tower(target, monkeypatch):
    """The prefill of rows without image tokens (a later turn) needs no image features."""
    engine = plain_engine(target)
    first = image_prompt(target, random_image(0))
    cache = engine.make_prompt_cache()
    answer = greedy(engine, first, cache=cache)
    later = first.extended(first.ids + answer + [5, 207, 4])
    towers = []
    monkeypatch.setattr(target.vision.vlm, "get_input_embeddings",
                        lambda *a, _real=target.vision.vlm.get_input_embeddings, **k: towers.append(1) or _real(*a, **k))
    assert greedy(engine, later, cache=cache) == greedy(engine, later)
    assert len(towers) == 1  # the fresh cache's prefill only
