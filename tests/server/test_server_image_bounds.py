"""Images are bounded before they are decoded (issue 46, item 7): a few small PNGs of huge
1-bit pictures decoded to gigabytes, and hundreds of one-pixel images each became a full
processor-sized array. Now a request's image count, its images' least prompt tokens and
their total pixels (read from the headers) are checked before any image is decoded. Served
as `mlx-spec serve` on a tiny Gemma 3 vision checkpoint; the server's peak resident memory is
read from /proc (VmHWM), its own high-water mark."""

import base64
import io

import httpx
import pytest

from server_support import assert_openai_error, serving, server_env

pytest_plugins = ["cli_fixtures"]  # fixtures: cost_cache

QUESTION = "What is this?"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from mlx_spec.testing.tiny_vision import save_tiny_gemma3_vision

    root = tmp_path_factory.mktemp("vision-bounds")
    save_tiny_gemma3_vision(root / "target")
    return root


@pytest.fixture(scope="module")
def server(files, cost_cache):
    yield from serving(["--model", files / "target", "--drafter", "none", "--parallel", 1],
                       server_env(cost_cache))


def png(width: int, height: int, mode: str = "1") -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new(mode, (width, height)).save(out, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def peak_rss_mib(server) -> float:
    with open(f"/proc/{server.proc.pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def ask(server, files, urls: list[str]) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return httpx.post(server.base + "/chat/completions", timeout=120, json={
        "model": str(files / "target"), "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": QUESTION}]}]})


def test_huge_pictures_in_small_files_are_refused_before_decoding(server, files):
    """Three 7000x7000 1-bit PNGs (each under the per-image limit of 50M pixels, 147M in
    all; about 25 KB of body each): refused from their headers, and the server's peak memory
    grows by far less than one decoded picture (147 MB as RGB, 49 MB as 1-bit)."""
    before = peak_rss_mib(server)
    huge = png(7000, 7000)
    assert len(huge) < 200_000
    response = ask(server, files, [huge] * 3)
    assert_openai_error(response, 400, "pixels in all")
    grown = peak_rss_mib(server) - before
    print(f"peak RSS {before:.0f} -> {peak_rss_mib(server):.0f} MiB (+{grown:.0f})")
    assert grown < 40, f"the server's peak memory grew by {grown:.0f} MiB"


def test_more_than_100_images_are_refused_before_decoding(server, files):
    response = ask(server, files, [png(1, 1, "RGB")] * 101)
    assert_openai_error(response, 400, "at most 100")


def test_images_whose_tokens_cannot_fit_the_context_are_refused_before_decoding(files, monkeypatch):
    """Each Gemma 3 image takes its fixed sequence of prompt tokens: more images than the
    context holds are refused by their count, none decoded (here decoding would fail)."""
    from mlx_spec.loading.loader import load_model
    from mlx_spec.server import images as images_module
    from mlx_spec.server.api_error import ApiError

    prompter = load_model(str(files / "target"), progress=False).vision.prompter
    parts = [{"type": "image", "url": png(1, 1, "RGB"), "where": f"messages[0].content[{i}]", "kind": "image_url"}
             for i in range(8)]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]

    def never(*args):
        raise AssertionError("an image was decoded")

    monkeypatch.setattr(images_module, "decode_image", never)
    with pytest.raises(ApiError) as refused:
        images_module.take_images(messages, prompter, False, False, context_length=8 * prompter.min_tokens)
    assert refused.value.status == 400 and "images alone need at least" in str(refused.value)


def test_a_slow_image_never_holds_another_requests_tokenizing(files, monkeypatch):
    """Images were read and processed on the one tokenizer thread: a request whose image
    took seconds (a slow URL, a big picture) held every other request's prompt. In-process,
    reading the image is made to take 3 s; a text request sent meanwhile is answered at once."""
    import threading
    import time

    from mlx_spec.core.engine import Engine
    from mlx_spec.loading.loader import load_model
    from mlx_spec.server import ServerOptions, create_app
    from mlx_spec.server import images as images_module
    from scripted_model import InProcessServer

    read = images_module.image_from_url

    def slow(*args, **kwargs):
        time.sleep(3)
        return read(*args, **kwargs)

    monkeypatch.setattr(images_module, "image_from_url", slow)
    target = load_model(str(files / "target"), progress=False)
    engine = Engine(target.model, eos_ids=target.tokenizer.eos_token_ids, vision=target.vision)
    served = InProcessServer(create_app(engine, target.tokenizer,
                                        ServerOptions(model_name="tiny", gamma="0", context_length=4096)))
    try:
        client = served.client()
        image = threading.Thread(target=lambda: client.chat.completions.create(
            model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png(8, 8, "RGB")}}, {"type": "text", "text": QUESTION}]}]))
        image.start()
        time.sleep(0.5)
        began = time.monotonic()
        client.chat.completions.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
        waited = time.monotonic() - began
        image.join(60)
    finally:
        served.stop()
    assert waited < 1.5, f"a text request waited {waited:.1f} s behind another request's image"
