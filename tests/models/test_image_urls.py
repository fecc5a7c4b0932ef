"""Image URLs (`serve --allow-image-urls`) against hostile image servers (issue 46, item 9): a
server that sends its body one byte at a time, redirects to ftp://, addresses on this machine
or its network, errors that told "refused", "404" and "not an image" apart. Served by a real
HTTP server on loopback in a thread (so the tests that fetch from it allow private
addresses, as `--allow-private-image-urls` does)."""

import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from mlx_spec.models import vision
from mlx_spec.server.api_error import ApiError
from mlx_spec.server.images import take_images
from mlx_spec.models.vision import ImageError, image_from_url


def _png() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


class Handler(BaseHTTPRequestHandler):
    ftp_port = 0

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.path == "/a.png":
            self._send(200, _png())
        elif self.path == "/text":
            self._send(200, b"not an image at all")
        elif self.path == "/to-ftp":
            self.send_response(302)
            self.send_header("Location", f"ftp://127.0.0.1:{Handler.ftp_port}/a.png")
            self.end_headers()
        elif self.path == "/to-png":
            self.send_response(302)
            self.send_header("Location", "/a.png")
            self.end_headers()
        elif self.path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            for _ in range(20):  # one byte a second, for 20 s, then the connection closes
                try:
                    self.wfile.write(b"\x89")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(1)
        else:
            self._send(404, b"missing")

    def _send(self, status: int, body: bytes):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def site():
    """(the HTTP server's base URL, a listener standing in for an FTP server, whose accepted
    connections are counted)."""
    ftp = socket.socket()
    ftp.bind(("127.0.0.1", 0))
    ftp.listen(4)
    ftp.settimeout(0.2)
    Handler.ftp_port = ftp.getsockname()[1]
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", ftp
    server.shutdown()
    ftp.close()


def fetch(url: str, **kwargs):
    try:
        return image_from_url(url, "messages[0].content[0]", allow_remote=True, allow_files=False, **kwargs)
    except TypeError:  # a version without these options
        return image_from_url(url, "messages[0].content[0]", allow_remote=True, allow_files=False)


def test_an_image_from_a_public_looking_url_is_read(site):
    base, _ = site
    assert fetch(base + "/a.png", allow_private=True).size == (4, 4)
    assert fetch(base + "/to-png", allow_private=True).size == (4, 4)  # an http redirect is followed


def test_a_slow_image_server_cannot_hold_the_request(site, monkeypatch):
    """Headers, then a byte a second: `urlopen`'s timeout is per socket read, so the fetch
    waited for the whole drip. Now the request's deadline bounds the whole body."""
    base, _ = site
    monkeypatch.setattr(vision, "FETCH_DEADLINE_S", 2.0, raising=False)
    began = time.monotonic()
    with pytest.raises(ImageError):
        fetch(base + "/drip", allow_private=True)
    assert time.monotonic() - began < 2.0 + 5.0 + 1.0  # the deadline, one read at most, slack


def test_a_redirect_to_ftp_is_not_followed(site):
    base, ftp = site
    with pytest.raises(ImageError):
        fetch(base + "/to-ftp", allow_private=True)
    with pytest.raises(socket.timeout):
        ftp.accept()[0].close()  # nobody connected


def test_private_addresses_are_refused_by_default(site):
    base, _ = site
    with pytest.raises(ImageError):
        fetch(base + "/a.png")
    with pytest.raises(ImageError):
        fetch(base.replace("127.0.0.1", "localhost") + "/a.png")


def test_every_fetch_failure_reads_the_same(site):
    """Refused, not found, not an image, private: one text, so answers cannot map which
    hosts and ports exist behind the server."""
    base, _ = site
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    messages = set()
    for url, private in ((f"http://127.0.0.1:{port}/a.png", True), (base + "/nothing", True),
                         (base + "/text", True), (base + "/a.png", False)):
        with pytest.raises(ImageError) as refused:
            fetch(url, allow_private=private)
        messages.add(str(refused.value))
    assert len(messages) == 1, messages


def test_at_most_16_image_urls_per_request():
    parts = [{"type": "image", "url": f"http://192.0.2.{i}/a.png", "where": f"messages[0].content[{i}]",
              "kind": "image_url"} for i in range(17)]
    messages = [{"role": "user", "content": parts}]
    with pytest.raises(ApiError, match="at most 16"):
        take_images(messages, SimpleNamespace(min_tokens=1), allow_remote=True)
