"""A local S3 endpoint (moto server) behind a fault-injecting HTTP proxy, and request counts.

The proxy sits between s3fs and moto and forwards every request unchanged, unless a rule
matches: then it answers an S3 error (500 InternalError, 503 SlowDown / ServiceUnavailable),
resets the connection, holds the request (a hang), or cuts a multipart upload short. Listings
can lag behind writes (keys written in the last ``lag_s`` seconds are left out of
``ListObjects`` answers, as on stores whose listings are eventually consistent). It counts the
requests by S3 operation, so a benchmark can report requests per save and load.

Nothing of the library is mocked: the library talks to a real S3 server through s3fs and
aiobotocore; only the network between them misbehaves.

    proxy = S3FaultProxy(moto_endpoint).start()
    proxy.add(Rule(op="PutObject", key=r"metadata\\.json$", action="status", status=503, times=2))
    ... point s3fs at proxy.endpoint ...
    proxy.counts  # Counter({"PutObject": 12, "HeadObject": 30, ...})
"""

from __future__ import annotations

import collections
import http.client
import json
import os
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Tuple

_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
    "<Resource>{resource}</Resource><RequestId>fault-proxy</RequestId></Error>"
)
_S3_CODES = {500: ("InternalError", "We encountered an internal error. Please try again."),
             503: ("SlowDown", "Please reduce your request rate.")}


def operation(method: str, path: str, query: Dict[str, List[str]], headers: Any) -> str:
    """The S3 operation of a request (path-style addressing: ``/bucket/key``)."""
    key = path.lstrip("/").partition("/")[2]
    if method == "PUT":
        if "partNumber" in query and "uploadId" in query:
            return "UploadPart"
        if headers.get("x-amz-copy-source"):
            return "CopyObject"
        return "PutObject" if key else "CreateBucket"
    if method == "POST":
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        if "delete" in query:
            return "DeleteObjects"
        return "Post"
    if method == "DELETE":
        return "AbortMultipartUpload" if "uploadId" in query else "DeleteObject"
    if method == "HEAD":
        return "HeadObject" if key else "HeadBucket"
    if method == "GET":
        if not key or "list-type" in query or "prefix" in query:
            return "ListObjects" if "uploads" not in query else "ListMultipartUploads"
        return "GetObject"
    return method


@dataclass
class Rule:
    """A fault for matching requests.

    ``op``: S3 operation name (see :func:`operation`) or None for any; ``key``: regex searched
    in the object key; ``action``: ``"status"`` (answer ``status`` with an S3 error body),
    ``"reset"`` (close the connection with a TCP reset, after reading the request), ``"hang"``
    (hold the request ``seconds`` - or until the proxy stops - then drop the connection without
    forwarding it), ``"drop_after"`` (forward it, then reset the connection instead of answering:
    the request took effect but the client does not know). ``skip`` matching requests pass
    first, then ``times`` of them (None: all) get the fault.
    """

    op: Optional[str] = None
    key: Optional[str] = None
    action: str = "status"
    status: int = 503
    code: Optional[str] = None
    seconds: float = 3600.0
    times: Optional[int] = 1
    skip: int = 0
    seen: int = 0
    fired: int = 0

    def matches(self, op: str, key: str) -> bool:
        if self.op is not None and self.op != op:
            return False
        return self.key is None or re.search(self.key, key) is not None

    def take(self) -> bool:
        """Count a matching request; True if this one gets the fault."""
        self.seen += 1
        if self.seen <= self.skip:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


@dataclass
class _State:
    rules: List[Rule] = field(default_factory=list)
    counts: "collections.Counter[str]" = field(default_factory=collections.Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    log: List[Tuple[str, str]] = field(default_factory=list)  # (operation, key) of every request
    written_at: Dict[str, float] = field(default_factory=dict)
    lag_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Any

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _answer(self, status: int, headers: List[Tuple[str, str]], body: bytes, head: bool = False) -> None:
        self.send_response(status)
        has_length = False
        for k, v in headers:
            kl = k.lower()
            if kl in ("transfer-encoding", "connection", "keep-alive", "server", "date"):
                continue
            if kl == "content-length":
                if not head:
                    continue
                has_length = True
            self.send_header(k, v)
        if not head or not has_length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)
        self.server.state.bytes_out += len(body)

    def _handle(self) -> None:
        state: _State = self.server.state
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        body = self._body()
        op = operation(self.command, url.path, query, self.headers)
        key = urllib.parse.unquote(url.path.lstrip("/").partition("/")[2])
        rule = None
        with state.lock:
            state.counts[op] += 1
            state.log.append((op, key))
            state.bytes_in += len(body)
            for r in state.rules:
                if r.matches(op, key) and r.take():
                    rule = r
                    break
        if rule is not None and rule.action == "status":
            code, message = _S3_CODES.get(rule.status, ("InternalError", "injected fault"))
            code = rule.code or code
            xml = _ERROR_XML.format(code=code, message=message, resource=url.path).encode()
            self._answer(rule.status, [("Content-Type", "application/xml")], xml, head=self.command == "HEAD")
            return
        if rule is not None and rule.action == "reset":
            self._reset()
            return
        if rule is not None and rule.action == "hang":
            state.stopping.wait(rule.seconds)
            self._reset()
            return
        status, headers, data = self._forward(body)
        if rule is not None and rule.action == "drop_after":
            self._reset()
            return
        if 200 <= status < 300 and op in ("PutObject", "CompleteMultipartUpload", "CopyObject"):
            with state.lock:
                state.written_at[key] = time.monotonic()
        if op == "ListObjects" and state.lag_s > 0 and status == 200:
            data = self._lagging(url.path, data)
        self._answer(status, headers, data, head=self.command == "HEAD")

    def _forward(self, body: bytes) -> Tuple[int, List[Tuple[str, str]], bytes]:
        conn = getattr(self, "_upstream", None)
        for attempt in range(2):
            if conn is None:
                conn = http.client.HTTPConnection(self.server.upstream_host, self.server.upstream_port, timeout=300)
                self._upstream = conn
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")}
                headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, list(resp.getheaders()), data
            except (http.client.HTTPException, OSError):
                conn.close()
                conn = self._upstream = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _lagging(self, path: str, data: bytes) -> bytes:
        """Leave keys (and prefixes holding only such keys) written less than ``lag_s`` ago out of a listing."""
        state: _State = self.server.state
        now = time.monotonic()
        with state.lock:
            fresh = {k for k, t in state.written_at.items() if now - t < state.lag_s}
            old = {k for k, t in state.written_at.items() if now - t >= state.lag_s}
        if not fresh:
            return data
        text = data.decode()

        def drop_contents(m: "re.Match[str]") -> str:
            k = re.search(r"<Key>(.*?)</Key>", m.group(0))
            return "" if k and _xml_unescape(k.group(1)) in fresh else m.group(0)

        def drop_prefix(m: "re.Match[str]") -> str:
            p = re.search(r"<Prefix>(.*?)</Prefix>", m.group(0))
            if not p:
                return m.group(0)
            prefix = _xml_unescape(p.group(1))
            visible = any(k.startswith(prefix) for k in old) or not any(k.startswith(prefix) for k in fresh)
            return m.group(0) if visible else ""

        text = re.sub(r"<Contents>.*?</Contents>", drop_contents, text, flags=re.S)
        text = re.sub(r"<CommonPrefixes>.*?</CommonPrefixes>", drop_prefix, text, flags=re.S)
        n = len(re.findall(r"<Contents>", text)) + len(re.findall(r"<CommonPrefixes>", text))
        text = re.sub(r"<KeyCount>\d+</KeyCount>", f"<KeyCount>{n}</KeyCount>", text)
        return text.encode()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle


def _xml_unescape(s: str) -> str:
    return s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&apos;", "'").replace("&amp;", "&")


class S3FaultProxy:
    """A forwarding proxy to ``upstream`` (``http://host:port``) with injected faults and request counts."""

    def __init__(self, upstream: str):
        u = urllib.parse.urlsplit(upstream)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.upstream_host, self.server.upstream_port = u.hostname, u.port
        self.server.state = _State()
        self._thread: Optional[threading.Thread] = None

    @property
    def state(self) -> _State:
        return self.server.state

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    @property
    def counts(self) -> "collections.Counter[str]":
        return self.state.counts

    def start(self) -> "S3FaultProxy":
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="s3-fault-proxy")
        self._thread.start()
        return self

    def stop(self) -> None:
        self.state.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    def add(self, *rules: Rule) -> None:
        with self.state.lock:
            self.state.rules.extend(rules)

    def clear(self) -> None:
        """Remove every rule and the listing lag; reset the counters."""
        with self.state.lock:
            self.state.rules.clear()
            self.state.lag_s = 0.0
            self.state.counts.clear()
            self.state.log.clear()
            self.state.bytes_in = self.state.bytes_out = 0

    def lag_listings(self, seconds: float) -> None:
        self.state.lag_s = seconds

    def reset_counts(self) -> "collections.Counter[str]":
        with self.state.lock:
            out = collections.Counter(self.state.counts)
            self.state.counts.clear()
            self.state.log.clear()
            self.state.bytes_in = self.state.bytes_out = 0
        return out


# --------------------------------------------------------------------------- the server and s3fs settings
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def start_moto() -> Tuple[Any, str]:
    """A moto S3 server on a free local port: ``(server, endpoint)``; ``server.stop()`` ends it."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # moto keeps its buckets in process-wide state shared by every server started in this process:
    # start each one empty, so that a test module never sees another module's buckets or objects
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(endpoint + "/moto-api/reset", method="POST"), timeout=30).close()
    return server, endpoint


# s3fs's own retry count is a class attribute, not a setting: carried to spawned ranks in this
# variable and applied by :func:`apply_client_retries` (called by :func:`use_endpoint`).
CLIENT_RETRIES_ENV = "CKPT_TEST_S3FS_RETRIES"


def apply_client_retries() -> None:
    """Give s3fs the retry count chosen by :func:`use_endpoint` (in a spawned rank: call it first)."""
    import s3fs

    raw = os.environ.get(CLIENT_RETRIES_ENV)
    if raw:
        s3fs.S3FileSystem.retries = int(raw)
    elif "_ckpt_default_retries" in vars(s3fs.S3FileSystem):
        s3fs.S3FileSystem.retries = s3fs.S3FileSystem._ckpt_default_retries


def use_endpoint(endpoint: str, retries: Optional[int] = None, **s3_options: Any) -> Dict[str, Optional[str]]:
    """Point s3fs at ``endpoint`` in this process (and spawned ranks, through the environment).

    Returns the previous environment values for :func:`restore`. ``retries``: s3fs's own
    attempts per request (default: s3fs's); ``s3_options``: more s3fs settings (fsspec
    config), e.g. ``default_block_size`` or ``config_kwargs``.
    """
    import fsspec
    import s3fs

    options = {"endpoint_url": endpoint, **s3_options}
    env = {**S3_ENV, "FSSPEC_S3": json.dumps(options), CLIENT_RETRIES_ENV: str(retries or "")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    if "_ckpt_default_retries" not in vars(s3fs.S3FileSystem):
        s3fs.S3FileSystem._ckpt_default_retries = s3fs.S3FileSystem.retries
    apply_client_retries()
    conf = fsspec.config.conf.setdefault("s3", {})
    conf.clear()
    conf.update(options)
    s3fs.S3FileSystem.clear_instance_cache()
    return old


def restore(old: Dict[str, Optional[str]]) -> None:
    import fsspec
    import s3fs

    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    apply_client_retries()
    fsspec.config.conf.pop("s3", None)
    s3fs.S3FileSystem.clear_instance_cache()


def s3_fixture(bucket: str = "ckpt-bucket", with_proxy: bool = False, **s3_options: Any) -> Any:
    """A module-scoped pytest fixture: moto (behind an :class:`S3FaultProxy` if ``with_proxy``), s3fs
    pointed at it, ``bucket`` created. Yields the proxy (``with_proxy``) or the endpoint URL."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture():  # type: ignore[no-untyped-def]
        pytest.importorskip("s3fs")
        pytest.importorskip("moto.server")
        server, endpoint = start_moto()
        proxy = S3FaultProxy(endpoint).start() if with_proxy else None
        old = use_endpoint(proxy.endpoint if proxy else endpoint, **s3_options)
        import fsspec

        fsspec.filesystem("s3").mkdir(bucket)
        try:
            yield proxy if proxy else endpoint
        finally:
            restore(old)
            if proxy:
                proxy.stop()
            server.stop()

    return fixture
