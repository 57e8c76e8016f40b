"""Waiting for a service the tests started as a process (a store server, a gateway) to answer; how long an ordinary
request may take after a hostile one."""

from __future__ import annotations

import subprocess
import time

import httpx

#: How long an ordinary write may take after a hostile one (the trust-boundary and fuzz tests): a store or gateway the
#: hostile value wedged spends its 30 s of retries first, the failure those tests guard against; a write on a loaded
#: machine takes a few seconds at worst. Not a speed target: what each write took is in their figures.
NOT_WEDGED_S = 10.0


def wait_healthy(url: str, proc: subprocess.Popen, *, timeout: float = 60.0, what: str = "the server",
                 path: str = "/v1/health") -> None:
    """Return once ``url`` + ``path`` (the store server's and the gateway's health; the viewer's is ``/health``)
    answers 200; fail, with the end of the process's stderr when it
    was piped, if the process exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}{path}", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stderr = proc.stderr.read() if proc.poll() is not None and proc.stderr is not None else b""
            text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else str(stderr)
            raise AssertionError(f"{what} did not start at {url} (exit code {proc.poll()}): {text[-2000:]}")
        time.sleep(0.2)
