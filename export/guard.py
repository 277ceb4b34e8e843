"""The HTTP guard: a small reverse proxy that serves the public HTTP port in front of Triton's.

Triton parses a request's JSON recursively: one body nested 200,000 levels deep (400 KB) makes
``tritonserver`` crash (SIGSEGV), and nothing bounds a body's size. The guard reads each request
whole, refuses it with its own JSON error (``{"error": "..."}``, as Triton's) without forwarding
it when

- the body is over ``max_body_bytes`` (413; a ``Content-Length`` over the limit is refused before
  the body is read; a gzip / deflate body counts at its decompressed size),
- its JSON is nested deeper than ``max_json_depth`` (400; a linear scan that skips JSON strings,
  over the JSON part alone when ``Inference-Header-Content-Length`` says binary tensors follow),
- a tensor declares a ``shape`` of more values than the body has bytes (400): every value takes at least a byte of
  the body (a JSON number and its comma, a string, or a binary element), and Triton's JSON reader allocates a
  tensor's declared bytes before it reads its data, so a 90-byte request declaring 2^41 values made it abort,
- its framing is malformed (400: a bad or repeated ``Content-Length``, both ``Content-Length`` and
  ``Transfer-Encoding``, a bad chunk, a body that is not the gzip / deflate data it claims to be, a
  header too long or folded over lines; 415 / 501 for an encoding other than gzip, deflate, chunked),

and otherwise forwards it to Triton's HTTP port on loopback over one kept-alive connection per
client connection. While Triton is down (restarting) a request gets 503 with ``Retry-After``.
Triton answers a request whose JSON it cannot read as a tensor request (text in a number tensor, a
``data`` of another shape, a number beyond float64, a bad surrogate escape, no ``inputs``) with 500,
as if the server had failed: the guard passes those answers on as 400, the request's fault.

Example::

    guard = HttpGuard("127.0.0.1", 8000, RequestLimits(64 << 20, 64))   # binds 127.0.0.1:8000 now
    guard.upstream = ("127.0.0.1", 8010)                                # Triton's own HTTP port
    guard.start()
    guard.stop()
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import json
import re
import socket
import socketserver
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

import numpy as np

CLIENT_TIMEOUT_S = 60.0
"""A client that stalls inside a request (its headers or body), or sends nothing on a new connection, is dropped
after this long without a byte; a kept-alive connection may idle between requests up to ``IDLE_TIMEOUT_S``."""
IDLE_TIMEOUT_S = 900.0
"""The longest a kept-alive connection waits for its next request (clients do not retry a POST on a connection closed
under them, so this is long)."""
MAX_CONNECTIONS = 1024
"""Connections held at once (a thread and a file each): one more is answered 503 and closed, so idle clients cannot
take every file the process may open, when the guard would answer no one."""
UPSTREAM_TIMEOUT_S = 600.0
"""The longest wait for Triton's answer to one request."""

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect",
               "content-length"}
_DIGITS = re.compile(r"[0-9]{1,18}")
_HEX = re.compile(rb"[0-9a-fA-F]{1,15}")
_STRUCTURE = b'[]{}"'
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(_STRUCTURE)))
_BLOCK = 1 << 20
_REQUEST_JSON_ERRORS = ("Unable to parse ", "failed to parse the request JSON buffer")
"""How Triton's errors about a request's JSON begin; it gives them status 500 (its JSON reader's errors are
INTERNAL)."""


@dataclass(frozen=True)
class RequestLimits:
    """What the guard lets through to Triton."""

    max_body_bytes: int
    max_json_depth: int


def json_depth(text: bytes) -> int:
    """How deeply the arrays and objects of JSON ``text`` nest (0 for a scalar), in linear time and
    memory, without parsing: brackets inside strings do not count, nor those after an unclosed quote.

    Escaped backslashes, then escaped quotes are dropped (what is left of a run of backslashes escapes
    the next character, as in JSON); then only quotes and brackets are kept, two quotes in a row are
    dropped (which changes no other quote's parity: most strings go) and a bracket counts when an even
    number of quotes comes before it. Where the text is not JSON, what follows the first error may be
    counted wrongly, but a parser stops there.
    """
    if b"\\" in text:
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    kept = text.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    has_quotes = b'"' in kept
    depth = deepest = quotes = 0
    for start in range(0, len(kept), _BLOCK):
        chars = np.frombuffer(kept, np.uint8, min(_BLOCK, len(kept) - start), start)
        steps = (chars & 2).view(np.int8) - 1  # [ and { have bit 1 set: +1; ] and }: -1
        if has_quotes:
            quote = chars == ord('"')
            quoted = np.cumsum(quote, dtype=np.int32) + quotes
            steps[quote | (quoted % 2 == 1)] = 0
            quotes = int(quoted[-1]) % 2
        running = np.cumsum(steps, dtype=np.int32) + depth
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


_SHAPE = re.compile(rb'"shape"\s*:\s*\[([^\]]*)\]')


def declared_beyond(text: bytes, body_bytes: int) -> str:
    """Why a tensor of the request's JSON ``text`` declares more values than a body of ``body_bytes`` can hold (each
    value takes a byte of it at least), or ``""``."""
    for match in _SHAPE.finditer(text):
        dims = match.group(1).split(b",")
        try:
            values = int(np.prod([int(d) for d in dims if d.strip()], dtype=object)) if match.group(1).strip() else 1
        except ValueError:
            continue  # not integers: Triton refuses the shape itself
        if values > body_bytes:
            shape = match.group(1).decode("ascii", "replace").replace(" ", "")
            return (f"a tensor declares shape [{shape}] ({values:,} values), more than the request's {body_bytes:,} "
                    "bytes can hold")
    return ""


class HttpGuard:
    """Serves ``host:port`` (0: a free port; bound when built) and forwards what is within ``limits`` to
    ``upstream`` (host, port), which may be set or changed at any time."""

    def __init__(self, host: str, port: int, limits: RequestLimits) -> None:
        self._server = _GuardServer((host, port), limits)
        self._thread: threading.Thread | None = None

    @property
    def upstream(self) -> tuple[str, int]:
        return self._server.upstream

    @upstream.setter
    def upstream(self, address: tuple[str, int]) -> None:
        self._server.upstream = address

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> HttpGuard:
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.1,), name="http-guard",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, and end the open connections on both sides (Triton waits for them to stop)."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()
        for handler in list(self._server.handlers):
            handler.disconnect()


class _GuardServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], limits: RequestLimits) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.upstream, self.limits = ("127.0.0.1", 0), limits
        self.handlers: set[_Handler] = set()
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        try:
            return super().get_request()
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):
                time.sleep(0.05)  # the listening socket stays readable: do not spin until a file is free
            raise

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if len(self.handlers) >= MAX_CONNECTIONS:
            body = b'{"error": "the server holds as many connections as it takes: retry shortly"}'
            with contextlib.suppress(OSError):
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(body), body))
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT_S
    server: _GuardServer
    _upstream: socket.socket | None = None
    _served_one = False  # a request came on this connection: the next may wait IDLE_TIMEOUT_S

    def setup(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.handlers.add(self)
        super().setup()

    def disconnect(self) -> None:
        for sock in (self.connection, self._upstream):
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_one_request(self) -> None:
        # A new connection sends its request within CLIENT_TIMEOUT_S, a kept-alive one its next within
        # IDLE_TIMEOUT_S; once a request starts, each read has CLIENT_TIMEOUT_S.
        self.connection.settimeout(IDLE_TIMEOUT_S if self._served_one else CLIENT_TIMEOUT_S)
        try:
            self.rfile.peek(1)
        except OSError:
            self.close_connection = True
            return
        self._served_one = True
        self.connection.settimeout(CLIENT_TIMEOUT_S)
        super().handle_one_request()

    def finish(self) -> None:
        self.server.handlers.discard(self)
        self._close_upstream()
        super().finish()

    def do_GET(self) -> None:
        try:
            body = self._read_body()
        except _Refused as refused:
            self._reply_error(refused.status, str(refused), close=True)
            self._drain()
            return
        except OSError:  # the client went away or stalled
            self.close_connection = True
            return
        try:
            depth = json_depth(self._json_part(body))
        except _Refused as refused:
            self._reply_error(refused.status, str(refused))
            return
        if depth > self.server.limits.max_json_depth:
            self._reply_error(400, f"the request's JSON nests {depth} levels deep, more than the "
                                   f"{self.server.limits.max_json_depth} allowed")
            return
        oversized = declared_beyond(self._json_part(body), len(body))
        if oversized:
            self._reply_error(400, oversized)
            return
        self._forward(body)

    do_POST = do_PUT = do_DELETE = do_GET

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue``: the body is invited only when the length it declares is allowed; a length over
        the limit is refused at once, before the client sends it."""
        lengths = self.headers.get_all("Content-Length") or []
        limit = self.server.limits.max_body_bytes
        if len(lengths) == 1 and _DIGITS.fullmatch(lengths[0].strip()) and int(lengths[0]) > limit:
            self._reply_error(413, f"the request body has {int(lengths[0])} bytes, more than the {limit} allowed "
                                   "(serve.max_request_mb)", close=True)
            return False
        return super().handle_expect_100()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line or headers) as JSON, like ours."""
        self._reply_error(code, message or self.responses.get(code, ("error",))[0], close=True)

    def log_message(self, format: str, *args) -> None:
        pass

    def _read_body(self) -> bytes:
        limit = self.server.limits.max_body_bytes
        lengths = self.headers.get_all("Content-Length") or []
        encodings = self.headers.get_all("Transfer-Encoding") or []
        if encodings:
            if lengths:
                raise _Refused(400, "a request may not have both Content-Length and Transfer-Encoding")
            if [e.strip().lower() for e in encodings] != ["chunked"]:
                raise _Refused(501, f"Transfer-Encoding {', '.join(encodings)} is not supported, only chunked")
            body = self._read_chunked(limit)
        elif lengths:
            if len(set(lengths)) > 1 or not _DIGITS.fullmatch(lengths[0].strip()):
                raise _Refused(400, f"bad Content-Length {', '.join(lengths)!r}: expected one decimal number")
            size = int(lengths[0])
            if size > limit:
                raise _Refused(413, f"the request body has {size} bytes, more than the {limit} allowed "
                                    "(serve.max_request_mb)")
            body = self._read_exactly(size)
        else:
            body = b""
        coding = ", ".join(self.headers.get_all("Content-Encoding") or ["identity"]).strip().lower()
        if coding in ("gzip", "deflate"):
            body = _decompressed(body, limit)
            del self.headers["Content-Encoding"]
        elif coding != "identity":
            raise _Refused(415, f"Content-Encoding {coding!r} is not supported: use one of gzip, deflate or none")
        return body

    def _read_chunked(self, limit: int) -> bytes:
        chunks, size = [], 0
        while True:
            line = self.rfile.readline(1024)
            size_text = line.split(b";", 1)[0].strip()
            if not line.endswith(b"\n") or not _HEX.fullmatch(size_text):
                raise _Refused(400, f"bad chunk size line {line[:40]!r} in a chunked body")
            length = int(size_text, 16)
            if length == 0:
                break
            size += length
            if size > limit:
                raise _Refused(413, f"the chunked request body is over the {limit} bytes allowed "
                                    "(serve.max_request_mb)")
            chunks.append(self._read_exactly(length))
            if self.rfile.readline(3) not in (b"\r\n", b"\n"):
                raise _Refused(400, "a chunk of a chunked body does not end where its size says")
        for _ in range(100):  # trailer lines, up to the blank line
            if self.rfile.readline(65537) in (b"\r\n", b"\n", b""):
                return b"".join(chunks)
        raise _Refused(400, "too many trailer lines after a chunked body")

    def _read_exactly(self, size: int) -> bytes:
        data = self.rfile.read(size)
        if len(data) < size:
            raise ConnectionAbortedError("the client closed the connection inside the body")
        return data

    def _json_part(self, body: bytes) -> bytes:
        """The JSON of ``body``: all of it, or its first Inference-Header-Content-Length bytes."""
        header = self.headers.get("Inference-Header-Content-Length")
        if header is None:
            return body
        if not _DIGITS.fullmatch(header.strip()) or int(header) > len(body):
            raise _Refused(400, f"bad Inference-Header-Content-Length {header!r}: expected a number of bytes "
                                f"up to the body's {len(body)}")
        return body[:int(header)]

    def _forward(self, body: bytes) -> None:
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        if any("\r" in v or "\n" in v for _, v in headers):
            self._reply_error(400, "a header value runs over several lines")
            return
        head = [f"{self.command} {self.path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers),
                f"Content-Length: {len(body)}"]
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
        for attempt in range(2):
            reused = self._upstream is not None
            try:
                if self._upstream is None:
                    self._upstream = socket.create_connection(self.server.upstream, timeout=UPSTREAM_TIMEOUT_S)
                    self._upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._upstream.sendall(request)
                reply = http.client.HTTPResponse(self._upstream, method=self.command)
                reply.begin()
                data = reply.read()
                break
            except TimeoutError:
                self._close_upstream()
                self._reply_error(504, f"the model server did not answer within {UPSTREAM_TIMEOUT_S:.0f} s")
                return
            except (OSError, http.client.HTTPException):
                self._close_upstream()  # a kept-alive connection Triton closed: one retry on a new one
                if attempt or not reused:
                    self._reply_error(503, "the model server is not available (restarting?): retry shortly",
                                      extra=[("Retry-After", "1")])
                    return
        if reply.will_close:
            self._close_upstream()
        status, reason = reply.status, reply.reason
        if status == 500 and _is_request_json_error(data):
            status, reason = 400, self.responses[400][0]
        headers = [(k, v) for k, v in reply.getheaders() if k.lower() not in _HOP_BY_HOP]
        self._reply(status, reason, headers, data)

    def _close_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def _drain(self) -> None:
        """Read and drop what the client still sends for a while, so that closing does not reset the
        connection before the client has read the refusal."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.5)
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and self.rfile.read1(1 << 16):
                pass
        except OSError:
            pass

    def _reply_error(self, status: int, message: str, close: bool = False,
                     extra: list[tuple[str, str]] = ()) -> None:
        headers = [("Content-Type", "application/json"), *extra]
        data = json.dumps({"error": message}).encode()
        self._reply(status, self.responses.get(status, ("Error",))[0], headers, data, close)

    def _reply(self, status: int, reason: str, headers: list[tuple[str, str]], data: bytes, close: bool = False) -> None:
        """The whole answer in one write (no wait on Nagle's algorithm)."""
        self.close_connection = self.close_connection or close
        head = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers), f"Content-Length: {len(data)}"]
        if self.close_connection:
            head.append("Connection: close")
        try:
            self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
        except OSError:
            self.close_connection = True


def _is_request_json_error(data: bytes) -> bool:
    """Whether Triton's error answer ``data`` says that it could not read the request's JSON."""
    try:
        message = json.loads(data).get("error", "")
    except (ValueError, AttributeError):
        return False
    return isinstance(message, str) and message.startswith(_REQUEST_JSON_ERRORS)


def _decompressed(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=47)  # gzip or zlib framing, told apart by the header
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error as err:
        raise _Refused(400, f"the body is not the gzip / deflate data its Content-Encoding says: {err}") from None
    if len(data) > limit:
        raise _Refused(413, f"the decompressed request body is over the {limit} bytes allowed (serve.max_request_mb)")
    if not inflater.eof or inflater.unused_data:
        raise _Refused(400, "the compressed body ends early or has data after its end")
    return data
