"""Socket tracking for the HTTP reward client: every socket an attempt opens is recorded, so that the attempt can be
cut off at its deadline.

:class:`_Sockets` keeps a duplicate of each socket (``shutdown`` on it wakes a read or write blocked on the original,
TLS included); :func:`_tracked` wraps an ``http.client`` connection class so that it registers its sockets there; the
urllib handlers in :data:`_HANDLERS` (HTTP, and HTTPS when Python has ssl) open their connections through it.
:class:`~marble_trl.rewards.http.HTTPReward` builds its opener from them.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from typing import Any


class _Sockets:
    """The sockets one attempt opened, kept as duplicates so that the caller can cut them off at the deadline.

    ``shutdown`` acts on the socket, not on one descriptor, so shutting a duplicate down wakes a read or write blocked
    on the original, even after TLS has wrapped it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._cancelled = False

    def add(self, sock: socket.socket) -> None:
        try:
            dup = sock.dup()
        except OSError:
            return
        with self._lock:
            if not self._cancelled:
                self._socks.append(dup)
                return
        self._cut(dup)  # the deadline passed while this connection was being opened

    def cancel(self) -> None:
        """Cut every connection of the attempt (at the deadline)."""
        with self._lock:
            self._cancelled = True
        self.close(cut=True)

    def close(self, cut: bool = False) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            self._cut(sock) if cut else sock.close()

    @staticmethod
    def _cut(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def _tracked(http_class: Any, sockets: _Sockets) -> Any:
    """Wrap an ``http.client`` connection class so that every socket it opens is registered in ``sockets``."""

    def connection(*args: Any, **kwargs: Any) -> Any:
        conn = http_class(*args, **kwargs)
        create = getattr(conn, "_create_connection", None)  # what HTTP(S)Connection.connect opens its socket with
        if create is not None:

            def create_and_track(*a: Any, **kw: Any) -> socket.socket:
                sock = create(*a, **kw)
                sockets.add(sock)
                return sock

            conn._create_connection = create_and_track
        return conn

    return connection


class _TrackedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, sockets: _Sockets) -> None:
        super().__init__()
        self._sockets = sockets

    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        return super().do_open(_tracked(http_class, self._sockets), req, **kwargs)


_HANDLERS: tuple[type, ...] = (_TrackedHTTPHandler,)
if hasattr(urllib.request, "HTTPSHandler"):  # Python built with ssl

    class _TrackedHTTPSHandler(urllib.request.HTTPSHandler):
        def __init__(self, sockets: _Sockets) -> None:
            super().__init__()
            self._sockets = sockets

        def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
            return super().do_open(_tracked(http_class, self._sockets), req, **kwargs)

    _HANDLERS += (_TrackedHTTPSHandler,)
