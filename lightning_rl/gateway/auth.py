"""The gateway's credentials: its token (opening rollouts, late rewards, the OpenAPI document) and each
open rollout's key (its own calls, rewards, finish and spans). A key opens nothing else. Credentials are
read from the bearer token or ``x-api-key`` (Anthropic's clients send the key there) and compare as
bytes (``boundaries.secret_matches``): a non-ASCII token is a mismatch, never an error."""

from __future__ import annotations

import time
from typing import Any

from ..boundaries import header_secret, secret_matches
from ..errors import GatewayError
from .rollouts import KEY_PREFIX, OpenRollout


class Auth:
    """Who may do what (a part of :class:`~lightning_rl.gateway.proxy.Gateway`, over its state)."""

    token: str | None
    rollouts: dict[str, OpenRollout]
    _by_key: dict[str, str]

    def _bearer(self, headers: Any) -> str | None:
        """The bearer token, or the ``x-api-key`` header (Anthropic's clients send the key there)."""
        scheme, _, given = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() == "bearer" and given.strip():
            return given.strip()
        return (headers.get("x-api-key") or "").strip() or None

    def check_admin(self, headers: Any) -> None:
        """The gateway's own token, where one is set (opening rollouts)."""
        if self.token is None:
            return
        given = self._bearer(headers)
        if not self._is_admin(given):
            raise GatewayError(401, f"{'missing' if given is None else 'wrong'} bearer token; send "
                                    "'Authorization: Bearer <token>' with the gateway's token (--token)")

    def _is_admin(self, given: str | None) -> bool:
        return self.token is None or secret_matches(header_secret(given), self.token)

    def rollout_for(self, rollout_id: str | None, headers: Any) -> OpenRollout:
        """The open rollout a request is for: named by its path, its key, or both (then they agree)."""
        given = self._bearer(headers)
        by_key = self._key_owner(given)
        if given and given.startswith(KEY_PREFIX) and by_key is None:
            raise GatewayError(401, "unknown rollout key; open a rollout with POST /v1/rollouts and use the "
                                    "api_key it answers with (a finished rollout's key no longer works)")
        if rollout_id is None:
            if by_key is None:
                raise GatewayError(401, "no rollout named: call through the rollout's base_url "
                                        "(/rollouts/{id}/v1) or send its api_key as the bearer token")
            rollout_id = by_key
        elif by_key is not None and by_key != rollout_id:
            raise GatewayError(403, f"this key belongs to another rollout than {rollout_id!r}; a rollout key "
                                    "writes only its own rollout")
        elif by_key is None and not self._is_admin(given):
            raise GatewayError(401, "send the rollout's api_key (or the gateway's token) as the bearer token")
        active = self.rollouts.get(rollout_id)
        if self.shared and (active is None or active.rollout is not None):  # a command's own stays here
            active = self._load_shared(rollout_id)
        if active is None:
            if self._finished(rollout_id):
                raise GatewayError(409, f"rollout {rollout_id!r} has finished; open a new one for more calls")
            raise GatewayError(404, f"unknown rollout {rollout_id!r}; open one with POST /v1/rollouts")
        active.last_seen = time.monotonic()
        return active

    def _finished(self, rollout_id: str) -> bool:
        try:
            return self.store.get_rollout(rollout_id).status.finished
        except Exception:
            return False

    def check_rollout_credentials(self, rollout_id: str, headers: Any) -> None:
        """A rollout's key or the gateway's token, before a body is read (401 or 403 either way, whether
        or not the rollout exists; the route itself then tells 404 from 409)."""
        given = self._bearer(headers)
        owner = self._key_owner(given)
        if owner is None and not self._is_admin(given):
            raise GatewayError(401, "send the rollout's api_key (or the gateway's token) as the bearer token")
        if owner is not None and owner != rollout_id:
            raise GatewayError(403, "this key belongs to another rollout; a rollout key writes only its own rollout")

    def check_spans_sender(self, rollout_id: str | None, headers: Any) -> str | None:
        """The credentials of an OTLP export, checked before its body is read: the gateway's token, or
        a rollout key (whose rollout is returned). 401 otherwise, whatever the body or path names."""
        given = self._bearer(headers)
        key_rollout = self._key_owner(given)
        if given and given.startswith(KEY_PREFIX) and key_rollout is None:
            raise GatewayError(401, "unknown rollout key; a finished rollout's key no longer works")
        if key_rollout is None and not self._is_admin(given):
            raise GatewayError(401, "send the rollout's api_key (or the gateway's token) as the bearer token")
        if rollout_id is not None:
            self.rollout_for(rollout_id, headers)
        return key_rollout

