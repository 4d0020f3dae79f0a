"""Images from data: URLs and (when allowed) http(s), under byte, pixel, format, host and redirect limits."""

import base64
import http.server
import io
import threading

import numpy as np
import pytest
from PIL import Image

from jaxllm.errors import InvalidRequestError
from jaxllm.multimodal.image_input import ImagePolicy, decode_image, load_image


def _encoded(fmt: str, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    rgb = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(rgb).save(buf, format=fmt)
    return buf.getvalue()


def _data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_urls_decode(fmt):
    image = load_image(_data_url(_encoded(fmt), f"image/{fmt.lower()}"), ImagePolicy())
    assert image.size == (40, 30) and image.format == fmt


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,not base64!", "base64"),
    (_data_url(b"not an image at all"), "could not be decoded"),
    (_data_url(_encoded("PNG")[:60]), "could not be decoded"),
    (_data_url(_encoded("PNG"), "text/plain"), "not an image"),
    ("data:image/png,rawdata", "data:<type>;base64"),
    ("ftp://example.com/a.png", "scheme"),
    ("https://example.com/a.png", "does not fetch remote images"),
    ("", "non-empty"),
])
def test_bad_images_are_refused(url, match):
    with pytest.raises(InvalidRequestError, match=match) as e:
        load_image(url, ImagePolicy())
    assert e.value.param == "messages"


def test_limits_apply_before_decoding():
    big = _encoded("PNG", (300, 200))
    with pytest.raises(InvalidRequestError, match="bytes"):
        load_image(_data_url(big), ImagePolicy(max_bytes=len(big) // 2))
    with pytest.raises(InvalidRequestError, match="pixels"):
        decode_image(big, ImagePolicy(max_pixels=300 * 200 - 1))
    buf = io.BytesIO()  # a blank 20000 x 20000 PNG is a few hundred KB: refused from its header
    Image.new("L", (20000, 20000)).save(buf, format="PNG")
    with pytest.raises(InvalidRequestError, match="pixel"):
        decode_image(buf.getvalue(), ImagePolicy(max_pixels=4096 * 4096))


@pytest.fixture(scope="module")
def image_server():
    png = _encoded("PNG")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/a.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(png)
            elif self.path.startswith("/redirect"):
                self.send_response(302)
                self.send_header("Location", self.path.split("?to=", 1)[1])
                self.end_headers()
            else:
                self.send_response(404)
                self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_images_when_allowed(image_server):
    allowed = ImagePolicy(allow_remote=True, allowed_hosts=("127.0.0.1",))
    assert load_image(image_server + "/a.png", allowed).size == (40, 30)
    assert load_image(f"{image_server}/redirect?to={image_server}/a.png", allowed).size == (40, 30)
    with pytest.raises(InvalidRequestError, match="does not fetch from"):
        load_image(image_server + "/a.png", ImagePolicy(allow_remote=True, allowed_hosts=("example.com",)))
    with pytest.raises(InvalidRequestError, match="redirected"):
        load_image(f"{image_server}/redirect?to=http://example.com/a.png", allowed)
    with pytest.raises(InvalidRequestError, match="could not fetch"):
        load_image(image_server + "/missing.png", allowed)
    with pytest.raises(InvalidRequestError, match="bytes"):
        load_image(image_server + "/a.png", ImagePolicy(allow_remote=True, max_bytes=100))
