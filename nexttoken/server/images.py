"""The images of a request, loaded once for every API (issue 43).

Each API writes its images as OpenAI's `image_url` content parts (Responses' `input_image`, Anthropic's `image`
blocks, Ollama's `images`, llama.cpp's `multimodal_data` / `image_data`: their protocol modules translate them);
here every such part becomes a decoded RGB image, checked against the server's limits (--max-images-per-request,
--max-image-pixels, --max-image-bytes): a `data:` URL is decoded in place; an http(s) URL is fetched only with
--allow-remote-images, within --remote-image-timeout and --max-image-bytes, and never from a private, loopback,
link-local or otherwise non-public address unless --allow-private-image-urls says so (fetching URLs a client names
is a request-forgery risk: the server would reach what the client cannot). What is wrong with an image is a 400
naming it and the message part that carried it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Any, Sequence
from urllib.parse import urlsplit

import httpx

from ..errors import ImageError
from ..images import ImageLimits, load_image
from .http.errors import bad_request
from .settings import ServerSettings

MAX_REDIRECTS = 3  # a remote image may move this often (each hop's address is checked again)


@dataclass(frozen=True)
class ImagePolicy:
    """What a server accepts: the limits, and whether (and where) it fetches http(s) image URLs."""

    limits: ImageLimits = ImageLimits()
    allow_remote: bool = False  # --allow-remote-images
    allow_private: bool = False  # --allow-private-image-urls: loopback and private networks too
    timeout_s: float = 10.0  # --remote-image-timeout: one fetch, connect to last byte

    @classmethod
    def of(cls, settings: ServerSettings) -> "ImagePolicy":
        limits = ImageLimits(settings.max_images_per_request, settings.max_image_pixels, settings.max_image_bytes)
        return cls(limits, settings.allow_remote_images, settings.allow_private_image_urls,
                   settings.remote_image_timeout_s)


@dataclass(frozen=True)
class ImageRef:
    """One image part of a request: where it is (`url`: a data: URL or an http(s) URL) and the field that
    carried it (`param`, e.g. messages.0.content.1)."""

    url: str
    param: str


def image_parts(messages: Sequence[dict[str, Any]]) -> list[ImageRef]:
    """The `image_url` parts of OpenAI-shaped messages, in prompt order."""
    refs = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                url = part["image_url"]["url"] if isinstance(part["image_url"], dict) else part["image_url"]
                refs.append(ImageRef(url, f"messages.{i}.content.{j}"))
    return refs


def refuse_images(refs: Sequence[ImageRef], model: str,
                  what: str = "content parts of type 'image_url' are not supported") -> None:
    """A model that takes no images: a request with one is a 400 naming the first (`what`: how it came)."""
    if refs:
        raise bad_request(f"{refs[0].param}: {what}: the model {model!r} takes no images (it has no vision "
                          "encoder); send text only, or serve a vision-language model", refs[0].param)


class ImageLoader:
    """A request's images as RGB PIL images: counted, fetched (when allowed) and decoded, off the event loop."""

    def __init__(self, policy: ImagePolicy = ImagePolicy()) -> None:
        self.policy = policy

    async def load(self, refs: Sequence[ImageRef]) -> list[Any]:
        """Every image of a request, in order; a 400 (APIError) naming the first that cannot be used."""
        if not refs:
            return []
        try:
            self.policy.limits.check_count(len(refs))
        except ImageError as e:
            raise bad_request(str(e), refs[-1].param) from e
        images = []
        for ref in refs:
            try:
                source: Any = ref.url
                if not ref.url.startswith("data:"):
                    source = await self.fetch(ref.url)
                images.append(await asyncio.to_thread(load_image, source, self.policy.limits))
            except ImageError as e:
                raise bad_request(f"{ref.param}: {e}", ref.param) from e
        return images

    async def fetch(self, url: str) -> bytes:
        """An http(s) image URL's bytes, under the policy (ImageError otherwise)."""
        try:
            scheme = urlsplit(url).scheme.lower()
            httpx.URL(url)
        except (ValueError, httpx.InvalidURL):
            raise ImageError(f"image URL {url[:80]!r} is not a valid URL") from None
        if scheme not in ("http", "https"):
            raise ImageError(f"image URL {url[:80]!r}: send a data:image/...;base64 URL or an http(s) URL")
        if not self.policy.allow_remote:
            raise ImageError(f"image URL {url[:80]!r}: this server does not fetch remote images; send the image "
                             "inline as a data:image/...;base64 URL (the server's operator can allow fetching with "
                             "--allow-remote-images)")
        try:
            return await asyncio.wait_for(self._fetch(url), self.policy.timeout_s)
        except asyncio.TimeoutError:
            raise ImageError(f"image URL {url[:80]!r}: not fetched within {self.policy.timeout_s:g} s "
                             "(--remote-image-timeout)") from None

    async def _fetch(self, url: str) -> bytes:
        async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                request = await self._pinned(client, url)
                try:
                    response = await client.send(request, stream=True)
                except httpx.HTTPError as e:
                    raise ImageError(f"image URL {url[:80]!r}: fetching it failed ({type(e).__name__})") from None
                try:
                    if not (response.is_redirect and "location" in response.headers):
                        return await self._body(url, response)
                    try:
                        url = str(httpx.URL(url).join(response.headers["location"]))  # its address checked again
                    except (ValueError, httpx.InvalidURL):
                        raise ImageError(f"image URL {url[:80]!r} redirects to an invalid URL") from None
                finally:
                    await response.aclose()
            raise ImageError(f"image URL {url[:80]!r}: more than {MAX_REDIRECTS} redirects")

    async def _body(self, url: str, response: httpx.Response) -> bytes:
        """A response's bytes, read no further than the limit."""
        limit = self.policy.limits.max_bytes
        if response.status_code != 200:
            raise ImageError(f"image URL {url[:80]!r}: the server answered {response.status_code}")
        size = int(response.headers.get("content-length") or 0)
        if size > limit:
            raise ImageError(f"image URL {url[:80]!r}: {size} bytes; at most {limit} are allowed (--max-image-bytes)")
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > limit:
                raise ImageError(f"image URL {url[:80]!r}: more than {limit} bytes; at most {limit} are allowed "
                                 "(--max-image-bytes)")
        return bytes(data)

    async def _pinned(self, client: httpx.AsyncClient, url: str) -> httpx.Request:
        """A GET of `url` sent to the address its host resolved to now, checked against the policy (the address
        is pinned: a DNS answer that changes between the check and the connection cannot point it elsewhere; TLS
        still checks the certificate against the host name)."""
        parts = httpx.URL(url)
        if parts.scheme not in ("http", "https") or not parts.host:
            raise ImageError(f"image URL {url[:80]!r}: only http(s) URLs with a host are fetched")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(parts.host, port, type=socket.SOCK_STREAM)
        except OSError:
            raise ImageError(f"image URL {url[:80]!r}: the host {parts.host!r} does not resolve") from None
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        if not self.policy.allow_private:
            for address in addresses:
                if not address.is_global:
                    raise ImageError(
                        f"image URL {url[:80]!r}: {parts.host} is {address}, a private, loopback or reserved "
                        "address; this server fetches only public addresses (--allow-private-image-urls allows "
                        "others)")
        return client.build_request("GET", parts.copy_with(host=str(addresses[0])),
                                    headers={"Host": parts.netloc.decode("ascii"), "Accept": "image/*"},
                                    extensions={"sni_hostname": parts.host})
