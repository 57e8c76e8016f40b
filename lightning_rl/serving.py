"""The HTTP services of lightning-rl (the store server, the gateway, the viewer) are served one way.

* :class:`Service`: what a service is called and which variable holds its token, for the one rule of
  :func:`check_bind`: bound beyond loopback, a service needs a token.
* :func:`run`: serve an ASGI app in this process until interrupted (uvicorn), after that check, with the
  options every service of ours takes (:func:`uvicorn_options`).
* :class:`BackgroundService`: an app on a thread of this process (tests, notebooks, one-process set-ups), on
  a socket bound at construction so ``port`` and ``url`` are known before it starts; a context manager.
  :class:`ServerThread` is the thread alone, for apps that are not services of ours (fake engines in tests).
* :data:`HEADER_TIMEOUT`: a connection that has not sent a whole request head (request line and headers)
  this many seconds after it opened, or after its previous answer, is closed. uvicorn has a keep-alive
  timeout but none for a head that never ends, so 200 connections sending one header byte a minute would
  be held open for ever (a slow-headers attack). :func:`uvicorn_options` puts the protocol that enforces it
  into every server we start.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ConfigurationError, StoreError
from .settings import ENV_GATEWAY_TOKEN, ENV_STORE_TOKEN, ENV_VIEW_TOKEN

#: Seconds a connection may take to send a whole request head (every server of ours).
HEADER_TIMEOUT = 10.0

@dataclass(frozen=True, slots=True)
class Service:
    """One of our HTTP services: how messages name it, what it would expose, where its token comes from."""

    name: str
    exposes: str
    token_variable: str


STORE_SERVER = Service("the store server", "the store", ENV_STORE_TOKEN)
GATEWAY = Service("the gateway", "the gateway and its engines", ENV_GATEWAY_TOKEN)
VIEWER = Service("the viewer", "your rollouts", ENV_VIEW_TOKEN)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(service: Service, host: str, token: str | None) -> None:
    """Bound beyond loopback, a service needs a token: otherwise a :class:`ConfigurationError` saying how."""
    if not token and not is_loopback(host):
        raise ConfigurationError(f"binding {service.name} to {host!r} exposes {service.exposes} beyond this machine; "
                                 f"give it a token (--token or {service.token_variable}), or bind to 127.0.0.1")


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



def check_port(service: Service, host: str, port: int) -> None:
    """The address is free to listen on; else a :class:`ConfigurationError` saying so (not uvicorn's log line
    after the service said it was serving)."""
    import socket

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host.strip("[]"), port))
        except OSError as exc:
            raise ConfigurationError(f"{service.name} cannot listen on {host}:{port} ({exc.strerror or exc}); another "
                                     "process may be serving there: stop it, or pick another --port") from None


def run(service: Service, app: Any, *, host: str, port: int, token: str | None, log_level: str = "warning",
        announce: Callable[[], None] | None = None, **uvicorn_kwargs: Any) -> None:
    """Serve ``app`` (or, with uvicorn's ``factory=True``, the import string of a factory) in this process
    until interrupted, after :func:`check_bind` and :func:`check_port`; ``announce()`` (the CLI's "serving ...
    on ...") is called once those hold, just before the server starts."""
    import uvicorn

    check_bind(service, host, token)
    check_port(service, host, port)
    if announce is not None:
        announce()
    uvicorn.run(app, host=host, port=port, log_level=log_level, **{**uvicorn_options(), **uvicorn_kwargs})


class BackgroundService:
    """``app`` served on a thread of this process, after :func:`check_bind`; ``with`` starts and stops it.
    Port 0 picks a free port. Subclasses add what they own (a store to close) in ``close``."""

    def __init__(self, service: Service, app: Any, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, header_timeout: float = HEADER_TIMEOUT) -> None:
        check_bind(service, host, token)
        self.service = service
        self._thread = ServerThread(app, host=host, port=port, name=f"lightning-rl {service.name}",
                                    header_timeout=header_timeout)
        self.port, self.url = self._thread.port, self._thread.url

    def __enter__(self):
        self._thread.start(self.service.name)
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.stop()
        self.close()

    def close(self) -> None:
        """What the service owns beyond its thread (nothing here)."""


__all__ = ["GATEWAY", "HEADER_TIMEOUT", "STORE_SERVER", "VIEWER", "BackgroundService", "ServerThread", "Service",
           "check_bind", "is_loopback", "run", "uvicorn_options"]
