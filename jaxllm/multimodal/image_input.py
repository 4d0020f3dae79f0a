"""Images as requests send them (an OpenAI ``image_url``: a ``data:`` URL, or http(s) when allowed), decoded into
Pillow images under limits: bytes before decoding, pixels before decompressing (a small PNG can declare a huge
canvas), formats, and for remote images an allow-list of hosts checked at every redirect, a time limit and a size
limit while reading. Every refusal is an `InvalidRequestError` naming the request field."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
import urllib.error
import urllib.parse
import urllib.request

from jaxllm.errors import InvalidRequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.S)


@dataclasses.dataclass(frozen=True)
class ImagePolicy:
    """What a server accepts. allow_remote: fetch http(s) URLs at all (off by default: a server would otherwise
    fetch whatever a client names, inside its own network); allowed_hosts: if set, only these hosts (and their
    subdomains), at every redirect."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 8192 * 8192
    allow_remote: bool = False
    allowed_hosts: tuple[str, ...] = ()
    timeout_s: float = 10.0
    max_redirects: int = 3

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_pixels < 1 or self.timeout_s <= 0 or self.max_redirects < 0:
            raise ValueError(f"bad image policy {self}")

    def host_allowed(self, url: str) -> bool:
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        return not self.allowed_hosts or any(host == h or host.endswith("." + h) for h in self.allowed_hosts)


def load_image(url: str, policy: ImagePolicy, param: str = "messages"):
    """The image at `url` (a ``data:`` URL, or http(s) if the policy allows), decoded (RGB or as stored)."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError("image_url must be a non-empty string", param)
    if url.startswith("data:"):
        return decode_image(_data_url_bytes(url, policy, param), policy, param)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise InvalidRequestError(f"image_url must be a data: URL or http(s), got scheme {scheme!r}", param)
    if not policy.allow_remote:
        raise InvalidRequestError("this server does not fetch remote images: send the image as a data: URL "
                                  "(base64)", param)
    return decode_image(_fetch(url, policy, param), policy, param)


def _data_url_bytes(url: str, policy: ImagePolicy, param: str) -> bytes:
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise InvalidRequestError("image_url: a data: URL must be data:<type>;base64,<data>", param)
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise InvalidRequestError(f"image_url: a data: URL of type {mime!r}, not an image", param)
    data = match.group("data")
    if len(data) * 3 // 4 > policy.max_bytes:  # refused before decoding the base64
        raise InvalidRequestError(f"image over {policy.max_bytes} bytes", param)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("image_url: invalid base64 data", param) from None


class _Redirects(urllib.request.HTTPRedirectHandler):
    def __init__(self, policy: ImagePolicy, param: str):
        self.policy, self.param, self.count = policy, param, 0

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.count += 1
        if self.count > self.policy.max_redirects:
            raise InvalidRequestError(f"image_url: more than {self.policy.max_redirects} redirects", self.param)
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https") or \
                not self.policy.host_allowed(newurl):
            raise InvalidRequestError("image_url: redirected to a host this server does not fetch from", self.param)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, policy: ImagePolicy, param: str) -> bytes:
    if not policy.host_allowed(url):
        raise InvalidRequestError("image_url: a host this server does not fetch from", param)
    opener = urllib.request.build_opener(_Redirects(policy, param))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "jaxllm"}), timeout=policy.timeout_s) as r:
            data = r.read(policy.max_bytes + 1)
    except InvalidRequestError:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise InvalidRequestError(f"image_url: could not fetch the image ({e})", param) from None
    if len(data) > policy.max_bytes:
        raise InvalidRequestError(f"image over {policy.max_bytes} bytes", param)
    return data


def decode_image(data: bytes, policy: ImagePolicy, param: str = "messages"):
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise InvalidRequestError(f"image over {policy.max_bytes} bytes", param)
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise InvalidRequestError("image over the pixel limit", param) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequestError("the image could not be decoded (PNG, JPEG, WebP, GIF or BMP expected)",
                                  param) from None
    if image.format not in FORMATS:
        raise InvalidRequestError(f"image format {image.format} is not accepted ({', '.join(FORMATS)})", param)
    if image.width * image.height > policy.max_pixels:  # before decompressing it
        raise InvalidRequestError(f"image of {image.width} x {image.height} pixels, over {policy.max_pixels}",
                                  param)
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError):
        raise InvalidRequestError("the image could not be decoded (truncated or corrupt)", param) from None
    return image
