"""The gateway, bridged into a sandbox that has no network: the only address a try's process can reach.

On the host, :class:`UnixBridge` listens on a Unix socket in a private folder and relays each connection to the
gateway's TCP address. The folder is bound into the sandbox; inside, :data:`INSIDE` (run by the system's
``python3``) listens on ``127.0.0.1:PORT`` of the sandbox's own network namespace, relays each connection to the
socket, and runs the try's command as its child, exiting with its status. The command is given the gateway's usual
URL (``http://127.0.0.1:PORT/...``): nothing else is reachable, not the host's loopback, not the internet.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

#: Where the bridge's folder is seen inside the sandbox.
INSIDE_FOLDER = "/run/lightning-rl"

#: Relays one direction of a connection until it ends (run on both sides: the host's bridge and the relay inside).
PUMP = r"""
def pump(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass
"""

#: The relay inside the sandbox: python3 -c INSIDE PORT SOCKET ARGV... (exits with the command's status)
INSIDE = "import os, socket, subprocess, sys, threading\n" + PUMP + r"""
port, path, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
def serve(listener):
    while True:
        client, _ = listener.accept()
        upstream = socket.socket(socket.AF_UNIX)
        try:
            upstream.connect(path)
        except OSError:
            client.close()
            continue
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=pump, args=(a, b), daemon=True).start()
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", port))
listener.listen(64)
threading.Thread(target=serve, args=(listener,), daemon=True).start()
code = subprocess.call(argv)
sys.stdout.flush()
os._exit(code if code >= 0 else 128 - code)
"""
_host: dict[str, object] = {"socket": socket}
exec(PUMP, _host)  # noqa: S102 - our own constant: the same relay loop on the host's side
_pump = _host["pump"]


def host_port(url: str) -> tuple[str, int]:
    """``http://HOST:PORT/...`` -> (HOST, PORT); refused, with the fix, when it names no port on this host."""
    from urllib.parse import urlsplit

    from ..errors import ConfigurationError

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ConfigurationError(f"gateway URL {url!r}: give http://HOST:PORT (the gateway's address, with its port)")
    return parts.hostname, parts.port


class UnixBridge:
    """A Unix socket (``path``, in a folder only this user can enter) relaying to ``host:port`` (the gateway)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.folder = Path(tempfile.mkdtemp(prefix="lrl-bridge-"))
        os.chmod(self.folder, 0o700)
        self.path = str(self.folder / "gateway.sock")
        self._listener = socket.socket(socket.AF_UNIX)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._closed = False
        threading.Thread(target=self._serve, name="lrl-sandbox-bridge", daemon=True).start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.host, self.port), timeout=30)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the sandbox behind the relay (the gateway at ``127.0.0.1:port`` in there)."""
        return ["python3", "-c", INSIDE, str(self.port), f"{INSIDE_FOLDER}/gateway.sock", *argv]

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "UnixBridge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
