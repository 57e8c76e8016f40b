"""Serving an ASGI app with uvicorn, for the store server, the gateway and the viewer alike.

* :class:`ServerThread`: an app on a thread of this process, on a socket bound at construction.
* :data:`HEADER_TIMEOUT`: a connection that has not sent a whole request head (request line and
  headers) this many seconds after it opened, or after its previous answer, is closed. uvicorn has a
  keep-alive timeout but none for a head that never ends, so 200 connections sending one header byte
  a minute would be held open for ever (a slow-headers attack). :func:`uvicorn_options` puts the
  protocol that enforces it into every server we start.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from typing import Any

from ..errors import StoreError

#: Seconds a connection may take to send a whole request head (``LIGHTNING_RL_*`` servers).
HEADER_TIMEOUT = 10.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools comes with the server extra; without it uvicorn's default is used
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

if HttpToolsProtocol is not None:
    class HeaderTimeoutProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's httptools protocol, closing a connection whose request head is not complete
        ``header_timeout`` seconds after the connection opened or its previous request began."""

        header_timeout = HEADER_TIMEOUT

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_too_slow)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if getattr(self, "_head_timer", None) is None:
                self._head_timer = self.loop.call_later(self.header_timeout, self._head_too_slow)

        def on_headers_complete(self) -> None:
            self._cancel_head_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _cancel_head_timer(self) -> None:
            timer = getattr(self, "_head_timer", None)
            if timer is not None:
                timer.cancel()
                self._head_timer = None

        def _head_too_slow(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()
else:  # pragma: no cover
    HeaderTimeoutProtocol = None  # type: ignore[assignment,misc]


def header_timeout_protocol(seconds: float = HEADER_TIMEOUT) -> Any:
    """The protocol class closing slow heads after ``seconds`` (None where httptools is missing)."""
    if HeaderTimeoutProtocol is None:
        return None
    if seconds == HEADER_TIMEOUT:
        return HeaderTimeoutProtocol
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": seconds})


def uvicorn_options(header_timeout: float = HEADER_TIMEOUT) -> dict[str, Any]:
    """What every server of ours passes to uvicorn besides its app, host and port."""
    options: dict[str, Any] = {"access_log": False}
    protocol = header_timeout_protocol(header_timeout)
    if protocol is not None:
        options["http"] = protocol
    return options


class ServerThread:
    """An ASGI app served by uvicorn on a thread of this process, on a socket bound at construction
    (so ``port`` and ``url`` are known before it starts). Port 0 picks a free port."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", port: int = 0, name: str = "lightning-rl-server",
                 header_timeout: float = HEADER_TIMEOUT) -> None:
        import socket

        import uvicorn

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                **uvicorn_options(header_timeout))
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name=name, daemon=True)

    def start(self, what: str) -> None:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise StoreError(f"{what} on {self.url} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._socket.close()


__all__ = ["HEADER_TIMEOUT", "ServerThread", "is_loopback", "uvicorn_options"]
