"""URI -> bytes, with the limits a service that fetches whatever a producer names needs.

Accepted: local paths and ``file://`` URLs inside ``allowed_roots`` (symlinks and ``..`` resolved before the
check); ``http(s)://`` through httpx with connect/read timeouts, a streamed size cap, retries with backoff for
transient failures against a deadline, and redirects followed one hop at a time with every hop re-checked; and
object-store URLs through fsspec (``s3://``, ``gs://``, ``az://``..., and ``memory://`` for tests) when the
protocol's fsspec implementation is installed.

Refused (``fetch_forbidden_scheme``): every other scheme, notably ``ftp``/``sftp``/``smb`` (credentials in the
clear, not object stores), ``data:`` (the producer should send bytes some other way; a data URI in a record is a
size-cap bypass) and ``javascript:``, plus fsspec wrappers that can reach the local disk or chain URLs
(``zip``, ``tar``, ``reference``, ``simplecache``, ``a::b`` chains...).

Hosts: by default any host whose addresses are loopback or private is refused (``allow_private_hosts`` allows
them, e.g. for a test server); link-local (169.254.0.0/16: cloud metadata), multicast, unspecified and reserved
addresses are always refused. The check resolves the name before connecting; a DNS server that answers
differently on the second lookup (rebinding) is not defended against here: run fetchers behind an egress proxy
when producers are untrusted.
"""

from __future__ import annotations

import ipaddress
import random
import socket
import time
import zlib
from urllib.parse import unquote, urljoin, urlsplit

from vlmstream.images.localfiles import (  # noqa: F401 - the fetch errors' home; callers import them from here
    FetchError,
    ForbiddenPath,
    IoError,
    LocalFiles,
    NotFound,
    TooLarge,
)


class BadUri(FetchError):
    error_kind = "fetch_bad_uri"


class ForbiddenScheme(FetchError):
    error_kind = "fetch_forbidden_scheme"


class ForbiddenHost(FetchError):
    error_kind = "fetch_forbidden_host"


class FetchTimeout(FetchError):
    error_kind = "fetch_timeout"
    retriable = True


class HttpError(FetchError):
    error_kind = "fetch_http_error"


# Object stores only: protocols that cannot be steered at the local disk or at another URL.
FSSPEC_PROTOCOLS = frozenset(
    {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss", "hdfs", "memory", "r2", "b2"}
)
MAX_REDIRECTS = 5


# What a slow server's timeout names: the whole fetch may take the connect timeout plus twice the read timeout.
TIMEOUT_SETTINGS = " (the limit: decode.http_connect_timeout_s + 2 x decode.http_read_timeout_s)"


class Fetcher:
    def __init__(
        self,
        *,
        allowed_roots: list[str] | tuple[str, ...] = (),
        allow_private_hosts: bool = False,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        retries: int = 3,
        max_bytes: int = 64 * 1024 * 1024,
        deadline_s: float | None = None,
        backoff_s: float = 0.25,
    ):
        self.local = LocalFiles(allowed_roots, max_bytes)
        self.roots = self.local.roots
        self.allow_private_hosts = allow_private_hosts
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.retries = retries
        self.max_bytes = max_bytes
        # Total time one URI may take across its attempts, so retries never hold a partition for long.
        self.deadline_s = deadline_s if deadline_s is not None else connect_timeout_s + 2 * read_timeout_s
        self.backoff_s = backoff_s
        self._client = None

    @classmethod
    def from_settings(cls, settings) -> "Fetcher":
        return cls(
            allowed_roots=settings.allowed_roots,
            allow_private_hosts=settings.allow_private_hosts,
            connect_timeout_s=settings.http_connect_timeout_s,
            read_timeout_s=settings.http_read_timeout_s,
            retries=settings.http_retries,
            max_bytes=settings.max_image_bytes,
        )

    def fetch(self, uri: str) -> bytes:
        if not uri.strip():  # would otherwise read as the first root, "is a directory"
            raise BadUri("empty URI")
        try:
            parts = urlsplit(uri)
        except ValueError as exc:
            raise BadUri(f"unparseable URI {uri[:200]!r}: {exc}") from exc
        scheme = parts.scheme.lower()
        if scheme == "" or (len(scheme) == 1 and uri[1:2] == ":"):
            return self._read_local(uri)
        if scheme == "file":
            if parts.netloc not in ("", "localhost"):
                raise ForbiddenHost(f"file URL with a remote host {parts.netloc!r}: {uri}")
            return self._read_local(unquote(parts.path))
        if scheme in ("http", "https"):
            return self._fetch_http(uri)
        if "::" in uri:
            raise ForbiddenScheme(f"chained fsspec URLs are not accepted: {uri[:200]}")
        if scheme in FSSPEC_PROTOCOLS:
            return self._fetch_fsspec(uri, scheme)
        raise ForbiddenScheme(f"scheme {scheme!r} is not accepted (local paths, file, http, https, object stores)")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- local files ---------------------------------------------------------------------------------------

    def _read_local(self, raw_path: str) -> bytes:
        return self.local.read(raw_path)

    # -- object stores -----------------------------------------------------------------------------------

    def _fetch_fsspec(self, uri: str, scheme: str) -> bytes:
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(uri)
        except (ImportError, ValueError) as exc:
            raise ForbiddenScheme(f"{scheme}:// needs its fsspec implementation installed: {exc}") from exc
        try:
            size = fs.size(path)
            if size is not None and size > self.max_bytes:
                raise TooLarge(f"{uri} has {size:,} bytes", self.max_bytes)
            with fs.open(path, "rb") as handle:
                data = handle.read(self.max_bytes + 1)
        except FileNotFoundError as exc:
            raise NotFound(f"{uri}: not found") from exc
        except PermissionError as exc:
            raise ForbiddenPath(f"{uri}: permission denied") from exc
        except (TimeoutError, ConnectionError) as exc:
            raise FetchTimeout(f"{uri}: {exc}") from exc
        if len(data) > self.max_bytes:
            raise TooLarge(uri, self.max_bytes)
        return data

    # -- http(s) ------------------------------------------------------------------------------------------

    def _http_client(self):
        if self._client is None:
            import httpx

            self._client = httpx.Client(
                follow_redirects=False,  # each hop is re-checked below
                timeout=httpx.Timeout(self.read_timeout_s, connect=self.connect_timeout_s),
                # identity: httpx would inflate each network chunk whole before our byte cap saw it (a gzip
                # bomb); a server that compresses anyway is inflated by _read_capped, within the cap.
                headers={"User-Agent": "vlmstream-decode/0.1", "Accept-Encoding": "identity"},
                trust_env=False,  # no proxy or netrc surprises from the environment
            )
        return self._client

    def _fetch_http(self, uri: str) -> bytes:
        deadline = time.monotonic() + self.deadline_s
        attempt = 0
        while True:
            try:
                return self._http_once(uri, deadline)
            except FetchError as exc:
                attempt += 1
                if not exc.retriable or attempt > self.retries:
                    raise
                delay = getattr(exc, "retry_after", None) or self.backoff_s * (2 ** (attempt - 1))
                delay *= 0.5 + random.random()  # jitter: a fleet of workers must not retry in lockstep
                if time.monotonic() + delay >= deadline:
                    raise
                time.sleep(delay)

    def _http_once(self, uri: str, deadline: float) -> bytes:
        import httpx

        client = self._http_client()
        url = uri
        for _hop in range(MAX_REDIRECTS + 1):
            self._check_http_url(url)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FetchTimeout(f"{url}: not fetched within {self.deadline_s:g}s{TIMEOUT_SETTINGS}")
            # httpx's timeouts apply per read: no single read may outlast the deadline either.
            timeout = httpx.Timeout(min(self.read_timeout_s, remaining),
                                    connect=min(self.connect_timeout_s, remaining))
            try:
                with client.stream("GET", url, timeout=timeout) as response:
                    if response.is_redirect:
                        location = response.headers.get("location")
                        if not location:
                            raise HttpError(f"{url}: redirect without Location")
                        url = urljoin(url, location)
                        continue
                    self._check_status(url, response)
                    return self._read_capped(url, response, deadline)
            except httpx.TimeoutException as exc:
                raise FetchTimeout(f"{url}: {type(exc).__name__}{TIMEOUT_SETTINGS}") from exc
            except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
                raise BadUri(f"{url[:200]}: {exc}") from exc
            except httpx.TransportError as exc:  # connection refused/reset, protocol errors: worth a retry
                raise HttpError(f"{url}: {type(exc).__name__}: {exc}", retriable=True) from exc
        raise HttpError(f"{uri}: more than {MAX_REDIRECTS} redirects")

    def _check_status(self, url: str, response) -> None:
        status = response.status_code
        if status < 400:
            return
        if status in (404, 410):
            raise NotFound(f"{url}: HTTP {status}")
        transient = status in (408, 429) or status >= 500
        error = HttpError(f"{url}: HTTP {status}", retriable=transient)
        retry_after = response.headers.get("retry-after", "")
        if retry_after.isdigit():
            error.retry_after = min(float(retry_after), 30.0)
        raise error

    def _read_capped(self, url: str, response, deadline: float) -> bytes:
        declared = response.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_bytes:
            raise TooLarge(f"{url}: Content-Length {int(declared):,}", self.max_bytes)
        inflater = _inflater_for(url, response.headers.get("content-encoding", ""))
        chunks, received, total = [], 0, 0
        # iter_raw() without a chunk size yields each network read as it arrives, so the deadline is checked
        # while a server drips bytes (iter_bytes(64 KiB) waited for 64 KiB first).
        for raw in response.iter_raw():
            received += len(raw)
            if received > self.max_bytes:
                raise TooLarge(f"{url}: its body", self.max_bytes)
            # httpx's read timeout is per read; a server dripping one byte at a time is stopped here.
            if time.monotonic() > deadline:
                raise FetchTimeout(f"{url}: body not received within {self.deadline_s:g}s{TIMEOUT_SETTINGS}")
            chunk = inflater.inflate(raw, self.max_bytes - total + 1) if inflater else raw
            total += len(chunk)
            if total > self.max_bytes:
                raise TooLarge(f"{url}: its body once decompressed", self.max_bytes)
            chunks.append(chunk)
        if inflater and not inflater.finished:
            raise HttpError(f"{url}: {inflater.encoding} body ends early")
        return b"".join(chunks)

    def _check_http_url(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https"):
            raise ForbiddenScheme(f"redirect to a non-http URL: {url[:200]}")
        host = parts.hostname
        if not host:
            raise ForbiddenHost(f"URL without a host: {url[:200]}")
        if parts.username or parts.password:
            raise ForbiddenHost("credentials in URLs are not accepted")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise BadUri(f"bad port in {url[:200]}: {exc}") from exc
        for address in _resolve(host, port):
            reason = self._forbidden_reason(address)
            if reason:
                raise ForbiddenHost(f"{host} resolves to {address} ({reason})")

    def _forbidden_reason(self, address: ipaddress._BaseAddress) -> str | None:
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        if address.is_link_local:
            return "link-local, e.g. cloud metadata"
        if address.is_multicast or address.is_unspecified:
            return "multicast/unspecified"
        if address.is_loopback or address.is_private:
            return None if self.allow_private_hosts else (
                "private/loopback; decode.allow_private_hosts (VLMSTREAM_DECODE__ALLOW_PRIVATE_HOSTS=true) allows it")
        if address.is_reserved or not address.is_global:
            return "reserved"
        return None


def _resolve(host: str, port: int) -> list[ipaddress._BaseAddress]:
    try:
        return [ipaddress.ip_address(host.strip("[]"))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        # EAI_AGAIN is a DNS server hiccup; a name that does not exist will not exist on retry either.
        raise HttpError(f"cannot resolve {host}: {exc}", retriable=exc.errno == socket.EAI_AGAIN) from exc
    except UnicodeError as exc:  # IDNA refuses the name before any lookup: an empty label or one over 63 chars
        raise BadUri(f"bad host name {host[:100]!r}: {exc}") from exc
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


class _Inflater:
    """One gzip or deflate layer, inflated as the raw bytes arrive and never past the output length asked for."""

    def __init__(self, url: str, encoding: str):
        self.url = url
        self.encoding = encoding
        self._first = True
        self._zlib = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS)

    @property
    def finished(self) -> bool:
        return self._zlib.eof

    def inflate(self, data: bytes, max_length: int) -> bytes:
        # Output stops at max_length (the cap + 1, so the caller sees the overflow); what is left of the input
        # is never inflated, since the caller then gives up on the response.
        first, self._first = self._first, False
        try:
            return self._zlib.decompress(data, max_length)
        except zlib.error as exc:
            if not (first and self.encoding == "deflate"):
                raise HttpError(f"{self.url}: body is not valid {self.encoding}: {exc}") from exc
        # Some servers send raw deflate without the zlib header the RFC asks for (httpx accepted those too).
        self._zlib = zlib.decompressobj(-zlib.MAX_WBITS)
        return self.inflate(data, max_length)


def _inflater_for(url: str, content_encoding: str) -> _Inflater | None:
    encodings = [token.strip().lower() for token in content_encoding.split(",")]
    encodings = [token for token in encodings if token and token != "identity"]
    if not encodings:
        return None
    # We ask for identity; a server that still stacks layers or uses br/zstd gets no decoder of its own here.
    if len(encodings) == 1 and encodings[0] in ("gzip", "x-gzip", "deflate"):
        return _Inflater(url, encodings[0])
    raise HttpError(f"{url}: unsupported Content-Encoding {content_encoding.strip()[:100]!r}")
