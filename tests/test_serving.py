"""The three HTTP services (store server, gateway, viewer) are served by one helper: one bind rule, one
background wrapper that starts, answers and stops the same way."""

import socket

import httpx
import pytest

from lightning_rl.errors import ConfigurationError
from lightning_rl.gateway import BackgroundGateway
from lightning_rl.serving import GATEWAY, STORE_SERVER, VIEWER, BackgroundService, check_bind
from lightning_rl.store import InMemoryStore
from lightning_rl.store.http.server import BackgroundServer
from lightning_rl.viewer import BackgroundViewer


def _services(tmp_path):
    return {
        STORE_SERVER: (lambda **kw: BackgroundServer(tmp_path / "s.db", **kw), "/v1/health"),
        GATEWAY: (lambda **kw: BackgroundGateway(["http://127.0.0.1:9"], **kw), "/v1/health"),
        VIEWER: (lambda **kw: BackgroundViewer(InMemoryStore(), **kw), "/health"),
    }


@pytest.mark.parametrize("service", [STORE_SERVER, GATEWAY, VIEWER], ids=lambda s: s.name)
def test_beyond_loopback_every_service_needs_a_token_named_by_its_variable(service, tmp_path):
    for host in ("127.0.0.1", "::1", "localhost"):
        check_bind(service, host, None)
    check_bind(service, "0.0.0.0", "s3cret")
    with pytest.raises(ConfigurationError, match=f"binding {service.name} to '0.0.0.0'.*--token or "
                                                 f"{service.token_variable}"):
        check_bind(service, "0.0.0.0", None)
    start, _ = _services(tmp_path)[service]
    with pytest.raises(ConfigurationError, match=service.token_variable):
        start(host="0.0.0.0")
    assert not (tmp_path / "s.db").exists()  # refused before anything was opened or created


@pytest.mark.parametrize("service", [STORE_SERVER, GATEWAY, VIEWER], ids=lambda s: s.name)
def test_every_service_runs_in_the_background_the_same_way(service, tmp_path):
    start, health = _services(tmp_path)[service]
    background = start()
    assert isinstance(background, BackgroundService) and background.service is service
    with background as running:
        assert running.url == f"http://127.0.0.1:{running.port}"
        assert httpx.get(running.url + health).status_code == 200
    with pytest.raises(OSError):  # stopped: nothing listens on its port any more
        socket.create_connection(("127.0.0.1", background.port), timeout=1).close()
