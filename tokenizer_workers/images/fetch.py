"""http(s) image URLs, fetched only when the server is configured to, within hard bounds.

* Off unless ``--image-fetch`` is given (``ImageFetchSettings.enabled``).
* One deadline for the whole fetch (connects, redirects, headers and body together), no retries.
* At most ``max_bytes`` of body (a larger Content-Length is refused before reading) and
  ``max_redirects`` redirects.
* Each hop's host is resolved once, and the connection goes to the address that was checked
  (no second lookup a DNS rebinding could answer differently). Private, loopback, link-local,
  multicast, reserved and unspecified addresses are refused unless the address is inside an
  allow-listed network (``allow_networks``, e.g. 127.0.0.1/32 for a local image server), and
  every redirect hop is checked again.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
import urllib.parse

from tokenmill.tokenizer_workers.settings import ImageFetchSettings


class FetchError(ValueError):
    pass


def _refused(address: ipaddress._BaseAddress) -> bool:
    return (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


class ImageFetcher:
    def __init__(self, settings: ImageFetchSettings):
        self.settings = settings
        self.allowed = [ipaddress.ip_network(n, strict=False) for n in settings.allow_networks]

    def fetch(self, url: str) -> bytes:
        if not self.settings.enabled:
            raise FetchError(
                "http(s) image URLs are not fetched by this server (start it with --image-fetch to allow "
                "them); send the image as a base64 data: URL"
            )
        deadline = time.monotonic() + self.settings.timeout_s
        for _ in range(self.settings.max_redirects + 1):
            status, headers, body = self._get(url, deadline)
            if status in (301, 302, 303, 307, 308):
                location = headers.get("location")
                if not location:
                    raise FetchError(f"the image URL redirected ({status}) without a Location")
                url = urllib.parse.urljoin(url, location)
                continue
            if status != 200:
                raise FetchError(f"fetching the image URL answered HTTP {status}")
            return body
        raise FetchError(f"the image URL redirected more than {self.settings.max_redirects} times")

    def _address(self, host: str, port: int, deadline: float) -> str:
        """The host resolved once; the address checked against the refused ranges and the allow-list."""
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise FetchError(f"the image URL's host {host!r} does not resolve: {exc}") from None
        if time.monotonic() > deadline:
            raise FetchError("fetching the image URL took longer than the deadline")
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if _refused(address) and not any(address in net for net in self.allowed):
                raise FetchError(
                    f"the image URL's host {host!r} resolves to {address}, a private, loopback or link-local "
                    "address, which this server does not fetch from"
                )
        return infos[0][4][0]

    def _get(self, url: str, deadline: float) -> tuple[int, dict, bytes]:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchError("image URLs must be http(s) URLs or base64 data: URLs")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = self._address(parts.hostname, port, deadline)
        left = deadline - time.monotonic()
        if left <= 0:
            raise FetchError("fetching the image URL took longer than the deadline")
        try:
            sock = socket.create_connection((address, port), timeout=left)
        except OSError as exc:
            raise FetchError(f"cannot connect to the image URL's host: {exc}") from None
        try:
            if parts.scheme == "https":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
            conn = http.client.HTTPConnection(parts.hostname, port)
            conn.sock = sock  # the checked address, never a second lookup
            path = parts.path or "/"
            if parts.query:
                path += "?" + parts.query
            conn.request("GET", path, headers={"Accept": "image/*", "User-Agent": "tokenmill"})
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            resp = conn.getresponse()
            headers = {k.lower(): v for k, v in resp.getheaders()}
            if resp.status != 200:
                return resp.status, headers, b""
            limit = self.settings.max_bytes
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                raise FetchError(f"the image at the URL has {length} bytes; at most {limit} are fetched")
            chunks, size = [], 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FetchError("fetching the image URL took longer than the deadline")
                sock.settimeout(left)
                chunk = resp.read1(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > limit:
                    raise FetchError(f"the image at the URL is over {limit} bytes, the most this server fetches")
                chunks.append(chunk)
            return 200, headers, b"".join(chunks)
        except (OSError, http.client.HTTPException) as exc:
            raise FetchError(f"fetching the image URL failed: {exc}") from None
        finally:
            sock.close()
