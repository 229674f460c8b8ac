"""The server of ``marble-trl serve-reward``: a reward behind the JSON protocol of ``http_reward`` (docs/rewards.md).

``POST <path>`` with ``{"prompts": [...], "images": [base64 PNG/JPEG, ...], "metadata": {column: [...]}}`` answers
``{"scores": [float | null, ...]}``; ``GET /health`` answers 200 once the reward is loaded, 503 while it warms up. The
reward gets what the trainer would give it: ``prompts``, ``images`` as a float ``[B, 3, H, W]`` tensor in ``[0, 1]``
(the files' uint8 pixels / 255, on the CPU) and every metadata column as a keyword argument; it is called through
:func:`~marble_trl.rewards.scoring.score_rewards` (the trainer's validation; ``None`` -> ``null``), under one lock.

Only the standard library's ``http.server``, JSON (nothing is unpickled) and Pillow restricted to PNG and JPEG.
Limits: the body (``Content-Length`` required; over ``max_request_bytes`` -> 413 before the body is read), the number
of images, each image's and the request's pixels (read from the file's header before any pixel is decoded), the time
a client has to send its request and read the answer (``client_timeout``: a deadline for the whole request, not per
read, so a client trickling bytes cannot hold a worker), the requests in flight (``max_concurrent_requests``: their
bodies are in memory) and the open connections (``max_connections``); more get 503, which ``http_reward`` retries.
Every refusal is a JSON ``{"error": ...}`` naming the problem; a reward that raises gets 500 with its message and the
server goes on serving. One request per connection (HTTP/1.0 framing). Images of different sizes in one request are
refused (400): the reward takes one ``[B, 3, H, W]`` tensor, as the trainer's batches are. Reading a request's body
(the limits, the JSON, the images) is :mod:`marble_trl.rewards.serve_protocol`; the server and its handler are here.
"""

from __future__ import annotations

import hmac
import io
import ipaddress
import json
import logging
import math
import re
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from .base import RewardError, check_reward_signature, reward_name
from .scoring import score_rewards
from .serve_protocol import RequestError, ServeLimits, parse_request

logger = logging.getLogger(__name__)

TOKEN_ENV = "MARBLE_REWARD_TOKEN"
LINGER_S = 5.0  # after refusing a body unread, how long to discard it so that the client can read the refusal
_LENGTH = re.compile(r"[0-9]{1,19}")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) only ever reaches this machine."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if not host:
        return False  # "": every interface
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def bind_warning(host: str, token: str | None) -> str | None:
    """The warning for binding ``host`` without a token, if it is reachable from other machines."""
    if token or is_loopback(host):
        return None
    return (
        f"binding {host or 'every interface'!r} without a token: anyone who can reach this port can use the reward "
        f"(and its GPU). Set ${TOKEN_ENV} (or --token), or bind 127.0.0.1 and reach it through an SSH tunnel."
    )


class _DeadlineReader(io.RawIOBase):
    """Socket reads bounded by what is left of the connection's deadline (a total, not a per-read, timeout)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client did not send its request within client_timeout")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Writer(io.BufferedIOBase):
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._sock.sendall(data)  # since 3.5 the socket timeout bounds the whole sendall
        return len(data)


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "marble-trl-reward"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: the deadline covers it whole

    def version_string(self) -> str:  # no Python version in the Server header
        return self.server_version

    def setup(self) -> None:
        self.connection = self.request
        self.started = time.monotonic()
        self.reader = _DeadlineReader(self.connection, self.started + self.server.limits.client_timeout)
        self.rfile = io.BufferedReader(self.reader, 65536)
        self.wfile = _Writer(self.connection)

    # ---------------------------------------------------------------------------------------------------- answers
    def reply(self, status: int, payload: dict[str, Any], unread: bool = False, headers: dict | None = None) -> None:
        """Send a JSON answer; with ``unread`` (a body left unread), then discard the body for a while so that the
        client, still sending, can read the answer instead of a reset connection."""
        data = json.dumps(payload).encode("utf-8")
        self.close_connection = True
        try:
            self.connection.settimeout(self.server.limits.client_timeout)  # bounds the whole sendall
            self.send_response(status)
            for key, value in {"Content-Type": "application/json", **(headers or {})}.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            if unread:
                self.connection.shutdown(socket.SHUT_WR)
                end = min(self.reader.deadline, time.monotonic() + LINGER_S)
                sink = bytearray(65536)
                while (left := end - time.monotonic()) > 0:
                    self.connection.settimeout(left)
                    if not self.connection.recv_into(sink):
                        break
        except OSError:  # the client went away, or did not read its answer in time
            pass

    def refuse(self, status: int, message: str, unread: bool = False, headers: dict | None = None) -> None:
        self.reply(status, {"error": message}, unread=unread, headers=headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, too many headers, an unknown method), as JSON."""
        self.log_error("code %d, message %s", code, message)
        text = message or HTTPStatus(code).phrase
        self.refuse(code, f"{text}: {explain}" if explain else text)

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        if self.server.log_requests:
            elapsed = time.monotonic() - self.started
            logger.info('%s "%s" %s %.3fs', self.client_address[0], self.requestline, code, elapsed)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        logger.warning("%s: %s", self.client_address[0], format % args)

    # --------------------------------------------------------------------------------------------------- requests
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/health":
            status, state = self.server.health()
            self.reply(status, state)
        elif path == self.server.path:
            self.refuse(405, f"{path} takes POST; GET /health for the status.", headers={"Allow": "POST"})
        else:
            self.refuse(404, f"no {path!r} here: POST {self.server.path}, GET /health.")

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        srv = self.server
        path = self.path.split("?", 1)[0]
        status, state = srv.health()
        if path != srv.path:
            problem = 404, f"no {path!r} here: POST {srv.path}, GET /health."
        else:  # refused before the body is read: the token, then the length, then the server's state
            problem = self.unauthorized() or self.bad_length()
        if problem is None and status != 200:
            problem = status, state.get("error") or f"reward {srv.name!r} is loading; retry (GET /health: ready?)"
        if problem is None and not srv.requests.acquire(blocking=False):
            problem = 503, f"over max_concurrent_requests = {srv.limits.max_concurrent_requests}; retry."
        if problem is not None:
            headers = {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": "1"}}.get(problem[0])
            return self.refuse(*problem, unread=True, headers=headers)
        try:
            self.score_body(int(self.headers["Content-Length"]))
        finally:
            srv.requests.release()

    def score_body(self, length: int) -> None:
        try:
            body = self.rfile.read(length)
        except (TimeoutError, OSError) as err:
            logger.warning("%s: %s; closing the connection", self.client_address[0], err)
            return self.refuse(408, f"the request was not received within client_timeout ({err}).")
        if len(body) < length:
            return self.refuse(400, f"the body ended after {len(body)} of its {length} bytes (Content-Length).")
        try:
            prompts, images, metadata = parse_request(body, self.server.limits)
            del body
            scores = self.server.score(prompts, images, metadata)
        except RequestError as err:
            return self.refuse(err.status, err.message)
        except RewardError as err:
            logger.error("reward %r failed: %s", self.server.name, err)
            return self.refuse(500, str(err))
        self.reply(200, {"scores": scores})

    def unauthorized(self) -> tuple[int, str] | None:
        if self.server.token is None:
            return None
        scheme, _, value = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            return 401, "this server needs a token: send the header 'Authorization: Bearer <token>'."
        if not hmac.compare_digest(value.strip().encode("utf-8"), self.server.token.encode("utf-8")):
            return 401, "wrong token in the Authorization header."
        return None

    def bad_length(self) -> tuple[int, str] | None:
        """Why the body's declared length is refused (none, chunked, not a number, over the cap), if it is."""
        values, limit = self.headers.get_all("Content-Length") or [], self.server.limits.max_request_bytes
        if "Transfer-Encoding" in self.headers or not values:
            return 411, "a Content-Length header is required (chunked bodies are not accepted)."
        if len(set(values)) != 1 or not _LENGTH.fullmatch(values[0].strip()):
            return 400, f"invalid Content-Length {', '.join(values)!r}."
        if int(values[0]) > limit:
            return 413, (
                f"the body is {int(values[0])} bytes, over max_request_bytes = {limit}; send fewer images per "
                "request (http_reward's batch_size) or image_format: jpeg."
            )
        return None


class RewardServer(ThreadingHTTPServer):
    """One reward behind the protocol, one thread per connection, the reward calls one at a time.

    ``start()`` serves from a background thread (and loads the reward: ``reward.load()`` if it has one) and returns at
    once; ``stop()`` stops accepting and waits up to ``grace`` seconds for the requests in flight. Also a context
    manager (``with RewardServer(...) as server: server.url``).
    """

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        reward: Any,
        *,
        name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        path: str = "/score",
        token: str | None = None,
        limits: ServeLimits | None = None,
        warmup: bool = True,
        log_requests: bool = False,
    ) -> None:
        self.reward, self.name = reward, name or reward_name(reward)
        check_reward_signature(reward, self.name)  # a class, or a signature no call can fit: refused before binding
        self.path = path if path.startswith("/") else f"/{path}"
        self.token = token or None
        self.limits = limits or ServeLimits()
        self.log_requests, self.warmup = log_requests, warmup
        if ":" in host.strip("[]"):
            self.address_family = socket.AF_INET6
        warning = bind_warning(host, self.token)
        if warning:
            logger.warning(warning)
        super().__init__((host.strip("[]"), port), _Handler)
        self._reward_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        self.requests = threading.BoundedSemaphore(self.limits.max_concurrent_requests)
        self._idle = threading.Condition()
        self._in_flight = 0
        self._ready = threading.Event()
        self.warmup_error: str | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}{self.path}"

    # ---------------------------------------------------------------------------------------------------- the reward
    def _warm_up(self) -> None:
        load = getattr(self.reward, "load", None)
        try:
            if self.warmup and callable(load):
                with self._reward_lock:
                    load()
        except Exception as err:  # reported by /health and to every request; the CLI exits
            self.warmup_error = f"reward {self.name!r} failed to load: {type(err).__name__}: {err}"
            logger.error(self.warmup_error)
            return
        self._ready.set()
        logger.info("reward %r ready", self.name)

    def health(self) -> tuple[int, dict[str, Any]]:
        if self._ready.is_set():
            return 200, {"status": "ready", "reward": self.name}
        if self.warmup_error:
            return 500, {"status": "failed", "reward": self.name, "error": self.warmup_error}
        return 503, {"status": "loading", "reward": self.name}

    def score(self, prompts: list[str], images: torch.Tensor | None, metadata: dict[str, list]) -> list:
        """The reward on one request, as the trainer calls it (one call at a time); ``NaN`` ("not applicable") ->
        ``None``. :class:`RequestError` for metadata the reward cannot take, :class:`RewardError` if it fails."""
        if images is None:
            return []
        try:
            check_reward_signature(self.reward, self.name, columns=list(metadata))
        except TypeError as err:
            raise RequestError(400, f"metadata columns {sorted(metadata)} do not fit the reward: {err}") from err
        with self._reward_lock, torch.no_grad():
            out = score_rewards([self.reward], prompts, images, metadata, [self.name])
        return [None if math.isnan(v) else v for v in out[0].tolist()]

    # ------------------------------------------------------------------------------------------------- connections
    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._reject_busy(request)
            return
        with self._idle:
            self._in_flight += 1
        try:
            super().process_request(request, client_address)  # a thread per connection
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        self._slots.release()
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def _reject_busy(self, request: socket.socket) -> None:
        body = json.dumps({"error": f"over max_connections = {self.limits.max_connections}; retry."}).encode()
        head = "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        try:
            request.settimeout(1.0)
            request.sendall(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        err = sys.exc_info()[1]
        logger.warning("%s: connection failed (%s: %s)", client_address[0], type(err).__name__, err)

    # ------------------------------------------------------------------------------------------------ start / stop
    def start(self) -> RewardServer:
        threading.Thread(target=self._warm_up, name="reward-warmup", daemon=True).start()
        self._thread = threading.Thread(target=self.serve_forever, args=(0.1,), name="reward-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, grace: float = 30.0) -> bool:
        """Stop accepting, close the port, wait up to ``grace`` s for the requests in flight; True if all ended."""
        if self._thread is not None:
            self.shutdown()
            self._thread = None
        self.server_close()
        end = time.monotonic() + grace
        with self._idle:
            while self._in_flight and (left := end - time.monotonic()) > 0:
                self._idle.wait(left)
            return self._in_flight == 0

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
