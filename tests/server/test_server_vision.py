"""`mlx-spec serve` on a tiny Gemma 3 vision checkpoint with a text-only draft model, driven by
the official openai and anthropic clients: an image in a chat drafts (acceptance reported)
and its greedy answer equals plain decoding of the same image prompt in-process (whose
equality with mlx-vlm's own generate `test_vision` checks); data URLs, local paths, file://
URLs and Anthropic base64 blocks give the same answer; URLs are not fetched by default; bad
images are one-line 400s in each API's error shape."""

import base64
from pathlib import Path

import anthropic
import openai
import pytest
from server_support import anthropic_error, assert_openai_error, server_env, serving
from vision_support import random_image

from mlx_spec.apps.stream import generate
from mlx_spec.core.engine import Engine
from mlx_spec.loading.loader import load_model

pytest_plugins = ["cli_fixtures"]  # fixtures: cost_cache

TOKENS = 24
QUESTION = "What is this?"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from mlx_spec.testing.tiny_vision import save_text_draft, save_tiny_gemma3_vision

    root = tmp_path_factory.mktemp("served-vision")
    target = save_tiny_gemma3_vision(root / "target")
    save_text_draft(root / "draft", target)
    for seed, name in ((0, "a.png"), (1, "b.png")):
        random_image(seed).save(root / name)
    return root


@pytest.fixture(scope="module")
def server(files, cost_cache):
    yield from serving(["--model", files / "target", "--draft-model", files / "draft", "--gamma", "3",
                        "--allow-image-files", "--prompt-cache-dir", files / "prompt-caches"],
                       server_env(cost_cache))


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def plain_answer(files, image: str) -> str:
    """Greedy decoding without drafting, in-process, of the chat the server is sent."""
    from PIL import Image

    target = load_model(str(files / "target"), progress=False)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    ids = list(target.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    prompt = target.vision.prompter.prompt(ids, [Image.open(files / image).convert("RGB")])
    engine = Engine(target.model, eos_ids=target.tokenizer.eos_token_ids, vision=target.vision)
    return generate(engine, target.tokenizer, prompt.ids, gamma=0, max_tokens=TOKENS, images=prompt).text


def ask(server, files, url: str, **kwargs):
    return server.client().chat.completions.create(
        model=str(files / "target"), max_tokens=TOKENS, temperature=0, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]}], **kwargs)


def test_openai_image_answer_drafts_and_equals_plain_decoding(server, files):
    answer = ask(server, files, data_url(files / "a.png"))
    assert answer.choices[0].message.content == plain_answer(files, "a.png")
    stats = answer.model_extra["mlx_spec"]
    assert stats["drafted"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    for url in (str(files / "a.png"), (files / "a.png").as_uri()):
        assert ask(server, files, url).choices[0].message.content == answer.choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       ask(server, files, data_url(files / "a.png"), stream=True) if chunk.choices)
    assert streamed == answer.choices[0].message.content
    other = ask(server, files, data_url(files / "b.png"))
    assert other.choices[0].message.content == plain_answer(files, "b.png") != answer.choices[0].message.content


def test_anthropic_image_block(server, files):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    message = client.messages.create(model=str(files / "target"), max_tokens=TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode((files / "b.png").read_bytes()).decode()}},
            {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == plain_answer(files, "b.png")
    response = server.post("/messages", {"model": str(files / "target"), "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                                     {"type": "text", "text": "hi"}]}]})
    assert "--allow-image-urls" in anthropic_error(response, 400, "invalid_request_error")


@pytest.mark.parametrize("url, fragments", [
    ("https://example.com/a.png", ["messages[0].content[0]", "--allow-image-urls"]),
    ("data:image/png;base64,%%%", ["not valid base64"]),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a but not really").decode(), ["not an image"]),
    ("/no/such/image.png", ["no such file"]),
    ("ftp://example.com/a.png", ["scheme 'ftp'"]),
])
def test_bad_images_are_one_line_400s(server, files, url, fragments):
    response = server.post("/chat/completions", {"model": str(files / "target"), "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]})
    error = assert_openai_error(response, 400, *fragments)
    assert error["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError):
        ask(server, files, url)


def test_a_server_reads_no_local_image_files_unless_allowed(files):
    """Without `serve --allow-image-files` a path or file: URL is a 400 naming the flag, the
    same whether the file exists, is no image, or is missing: a client cannot probe the disk."""
    from mlx_spec.server.api_error import ApiError
    from mlx_spec.server.images import take_images

    errors = []
    for url in (str(files / "a.png"), (files / "a.png").as_uri(), str(files / "target" / "config.json"),
                "/no/such/image.png"):
        message = {"role": "user", "content": [{"type": "image", "url": url, "where": "messages[0].content[0]",
                                                "kind": "image_url"}]}
        with pytest.raises(ApiError) as raised:
            take_images([message], prompter=object(), allow_remote=False)
        errors.append(str(raised.value))
    assert len(set(errors)) == 1 and "--allow-image-files" in errors[0], errors
