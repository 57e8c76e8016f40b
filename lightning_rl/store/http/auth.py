"""Who may do what on a store server: tokens with roles, and the role each route needs.

Roles (a token holds one or more; ``admin`` may do everything):

* ``runner``: what a runner machine, the tracer in an agent's process and a gateway's writes need:
  write rollouts, spans, rewards and finishes (``POST /v1/batch``, a late reward ``POST /v1/rewards``),
  lease, heartbeat and complete tries, read the queue entries of named groups (``wait_for_groups``) and
  the publishes and decisions the tracer stamps calls from. Not: any rollout's spans, rewards, task or
  trajectory, the rollout lists, erasure, enqueueing or cancelling tries, publishes, decisions.
* ``reader``: the viewer, exports, ``rollouts ls|show``, the doctor: every read, no write.
* ``admin``: everything, erasure (``store prune``, ``POST /v1/rollouts/delete``), enqueueing and cancelling
  tries, publishes, decisions and rollbacks included: the trainer's token.

:data:`ROUTE_ROLES` names, for every route of the app, the roles that may call it; ``create_app``
refuses to build an app with a route the table does not name (:func:`route_table`), so a route without
a role cannot be served. A wrong role gets 403 naming the role needed; no token or an unknown one, 401.

Where tokens come from (:class:`Tokens`):

* ``--token`` / ``LIGHTNING_RL_STORE_TOKEN``: one ``admin`` token (what it was before roles).
* ``--tokens FILE`` / ``LIGHTNING_RL_STORE_TOKENS_FILE``: one token a line, ``ROLES TOKEN``: ``ROLES`` is
  a role or several joined by commas (``runner,reader``), ``TOKEN`` is ``sha256:`` and the hex SHA-256 of
  the token (what ``lightning-rl store token`` prints: the file then holds no secret), or the token itself
  (at least 16 characters). ``#`` starts a comment. The server reads the file again when it has changed,
  checking at most every :data:`RELOAD_EVERY` seconds, so tokens are added and revoked without a restart:
  a removed token is refused within that time. A file that cannot be read or parsed any more refuses
  every token it held (fail closed: the admin token still works), logged once per cause and counted
  (``store_tokens_file_invalid``) until it is fixed; at start-up it is a one-line error.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...diagnostics import count, report_failure
from ...errors import ConfigurationError
from ...settings import ENV_STORE_TOKENS_FILE
from .. import wire

RUNNER, READER, ADMIN = "runner", "reader", "admin"
ROLES = (RUNNER, READER, ADMIN)
#: Seconds between two looks at the tokens file (the longest a removed token still works).
RELOAD_EVERY = 1.0
#: Shortest token accepted as written in the tokens file (minted ones are 43 characters of 256 random bits).
MIN_PLAIN_TOKEN = 16
TOKEN_PREFIX = "lrl_"

_P = wire.API_PREFIX
_ADMIN = frozenset({ADMIN})
_RUN = frozenset({RUNNER, ADMIN})
_READ = frozenset({READER, ADMIN})
_RUN_OR_READ = frozenset({RUNNER, READER, ADMIN})

#: (method, route path) -> the roles that may call it. Every route of the app is here (create_app checks).
ROUTE_ROLES: dict[tuple[str, str], frozenset[str]] = {
    # writing records of rollouts (the tracer's background writer; a late reward)
    ("POST", f"{_P}/batch"): _RUN,
    ("POST", f"{_P}/rewards"): _RUN,
    # the queue: runners lease, beat and complete; the trainer enqueues and cancels
    ("POST", f"{_P}/queue/lease"): _RUN,
    ("POST", f"{_P}/queue/heartbeat"): _RUN,
    ("POST", f"{_P}/queue/complete"): _RUN,
    ("POST", f"{_P}/queue/entries"): _RUN_OR_READ,
    ("POST", f"{_P}/queue/enqueue"): _ADMIN,
    ("POST", f"{_P}/queue/cancel"): _ADMIN,
    # publishes and decisions: the tracer reads them to stamp calls; only the trainer records them
    ("GET", f"{_P}/policies"): _RUN_OR_READ,
    ("GET", f"{_P}/decisions"): _RUN_OR_READ,
    ("POST", f"{_P}/policies"): _ADMIN,
    ("POST", f"{_P}/decisions"): _ADMIN,
    # what rollouts hold: readers only
    ("GET", f"{_P}/rollouts"): _READ,
    ("POST", f"{_P}/rollouts/page"): _READ,
    ("GET", f"{_P}/rollouts/{{rollout_id}}"): _READ,
    ("GET", f"{_P}/rollouts/{{rollout_id}}/spans"): _READ,
    ("GET", f"{_P}/rollouts/{{rollout_id}}/rewards"): _READ,
    ("GET", f"{_P}/rollouts/{{rollout_id}}/trajectory"): _READ,
    ("POST", f"{_P}/rollout_data"): _READ,
    ("GET", f"{_P}/rollout_ids"): _READ,
    ("GET", f"{_P}/rewards"): _READ,
    ("GET", f"{_P}/quarantine"): _READ,
    ("GET", f"{_P}/stats"): _READ,
    # erasure
    ("POST", f"{_P}/rollouts/delete"): _ADMIN,
}
assert all(ADMIN in roles for roles in ROUTE_ROLES.values()), "admin may call every route"


def check_roles(text: str, *, what: str = "role") -> frozenset[str]:
    """``runner``, ``reader,runner``...: the set, or a one-line ConfigurationError naming the known roles."""
    roles = frozenset(r.strip() for r in text.split(",") if r.strip())
    unknown = sorted(roles - set(ROLES))
    if not roles or unknown:
        raise ConfigurationError(f"{what} {text!r} is not a role; use {', '.join(ROLES)} (several joined by "
                                 "commas, e.g. runner,reader)")
    return roles


def token_digest(token: str) -> str:
    """The form a tokens file keeps a token in: ``sha256:`` and the hex digest."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class MintedToken:
    """A new token and the tokens-file line that grants its roles (the line holds only its digest)."""

    roles: tuple[str, ...]
    token: str
    line: str


def mint_token(roles: str | list[str] | tuple[str, ...]) -> MintedToken:
    """A new random token (256 bits) for ``roles``, and the line to append to the server's tokens file."""
    names = check_roles(roles if isinstance(roles, str) else ",".join(roles))
    ordered = tuple(r for r in ROLES if r in names)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return MintedToken(ordered, token, f"{','.join(ordered)} {token_digest(token)}")


def parse_tokens(text: str, *, where: str = "the tokens file") -> dict[str, frozenset[str]]:
    """A tokens file's text as {digest: roles}; a one-line ConfigurationError naming the line and the fix."""
    table: dict[str, frozenset[str]] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ConfigurationError(f"{where}, line {number}: {line[:60]!r} is not 'ROLES TOKEN'; write e.g. "
                                     "'runner sha256:HEX' (lightning-rl store token --role runner prints one)")
        roles = check_roles(parts[0], what=f"{where}, line {number}:")
        secret = parts[1]
        if secret.startswith("sha256:"):
            hexpart = secret[len("sha256:"):].lower()
            if len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
                raise ConfigurationError(f"{where}, line {number}: {secret[:20]!r}... is not sha256: and 64 hex "
                                         "digits; copy the line lightning-rl store token printed")
            digest = "sha256:" + hexpart
        elif len(secret) < MIN_PLAIN_TOKEN:
            raise ConfigurationError(f"{where}, line {number}: a token of {len(secret)} characters is too short "
                                     f"to be secret (at least {MIN_PLAIN_TOKEN}); mint one with lightning-rl store "
                                     "token --role ROLE")
        else:
            digest = token_digest(secret)
        table[digest] = table.get(digest, frozenset()) | roles
    return table


class Tokens:
    """The tokens a server accepts and their roles: the admin token, and a tokens file read again when it
    changes (module doc). ``enabled`` is False when there is neither: no auth (a loopback server)."""

    def __init__(self, admin_token: str | None = None, tokens_file: str | os.PathLike[str] | None = None, *,
                 reload_every: float = RELOAD_EVERY) -> None:
        self._admin = admin_token.encode() if admin_token else None
        self.path = Path(tokens_file) if tokens_file else None
        self.reload_every = reload_every
        self._text: str | None = None
        self._table: dict[str, frozenset[str]] = {}
        self._checked = 0.0
        if self.path is not None:  # at start-up a bad file is the user's mistake: one line, nothing served
            self._text = self._read()
            self._table = parse_tokens(self._text, where=f"tokens file {str(self.path)!r}")
            self._checked = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self._admin is not None or self.path is not None

    def _read(self) -> str:
        try:
            return self.path.read_text()  # type: ignore[union-attr]
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"tokens file {str(self.path)!r} cannot be read ({exc}); give the path of a "
                                     f"file of 'ROLES TOKEN' lines (--tokens or {ENV_STORE_TOKENS_FILE})") from None

    def _refresh(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._checked < self.reload_every:
            return
        self._checked = now
        try:
            text = self._read()
            if text == self._text:
                return
            table = parse_tokens(text, where=f"tokens file {str(self.path)!r}")
        except ConfigurationError as exc:  # fail closed until it is fixed; the admin token still works
            self._text, self._table = None, {}
            report_failure(f"store_tokens_file_invalid: {exc}", message=(
                f"lightning-rl: {exc}; the store server refuses every token of that file until it is fixed"))
            count("store_tokens_file_invalid")
            return
        self._text, self._table = text, table
        count("store_tokens_reloaded")

    def roles_of(self, given: bytes) -> frozenset[str] | None:
        """The roles of a bearer token, or None for a token this server does not know."""
        if self._admin is not None and hmac.compare_digest(given, self._admin):
            return frozenset(ROLES)
        self._refresh()
        if not self._table or not given:
            return None
        roles = self._table.get("sha256:" + hashlib.sha256(given).hexdigest())
        return frozenset(ROLES) if roles is not None and ADMIN in roles else roles


class RouteRoles:
    """The roles each request may come with: found by the route it reaches (``route_table``)."""

    def __init__(self, exact: dict[tuple[str, str], frozenset[str]],
                 patterns: list[tuple[str, Any, frozenset[str]]]) -> None:
        self._exact = exact
        self._patterns = patterns

    def allowed(self, method: str, path: str) -> frozenset[str] | None:
        """The roles that may send ``method path``; None where no route matches (the app answers 404)."""
        found = self._exact.get((method, path))
        if found is not None:
            return found
        for want, regex, roles in self._patterns:
            if want == method and regex.match(path):
                return roles
        return None


def route_table(app: Any, open_paths: frozenset[str]) -> RouteRoles:
    """The roles of every route of ``app``: a ConfigurationError naming a route :data:`ROUTE_ROLES` does not
    assign, so that no route can be served without a role."""
    from fastapi.routing import APIRoute

    exact: dict[tuple[str, str], frozenset[str]] = {}
    patterns: list[tuple[str, Any, frozenset[str]]] = []
    for route in app.routes:
        path = getattr(route, "path", None)
        if path in open_paths:
            continue
        if not isinstance(route, APIRoute):
            raise ConfigurationError(f"the store server's route {path!r} is not an API route and not open; add it "
                                     "to server.OPEN_PATHS or serve it as an API route with a role")
        for method in sorted(route.methods):
            roles = ROUTE_ROLES.get((method, path))
            if roles is None:
                raise ConfigurationError(f"the store server's route {method} {path} has no role; add it to "
                                         f"ROUTE_ROLES in {__name__} ({', '.join(ROLES)})")
            if "{" in path:
                patterns.append((method, route.path_regex, roles))
            else:
                exact[(method, path)] = roles
    return RouteRoles(exact, patterns)


#: The ASGI scope key under which the guard leaves the roles of a request's token, for routes whose rule
#: depends on the body (``queue_listing_refused``).
SCOPE_ROLES = "lightning_rl.roles"


def request_roles(scope: dict) -> frozenset[str]:
    """The roles of the request's token (every role on a server without tokens)."""
    return scope.get(SCOPE_ROLES, frozenset(ROLES))


def queue_listing_refused(scope: dict, group_ids: list[str] | None) -> str | None:
    """A runner reads the entries of the groups it names (``wait_for_groups``), not the whole queue: the 403
    message for a request without ``group_ids`` from a token that cannot read, else None."""
    roles = request_roles(scope)
    if group_ids is not None or READER in roles:
        return None
    return refusal("POST", f"{_P}/queue/entries without group_ids (the whole queue)", roles, _READ)


def refusal(method: str, path: str, held: frozenset[str], allowed: frozenset[str]) -> str:
    """The one-line 403 message: the route, the role it needs, the role the token has, the fix."""
    needed = [r for r in ROLES if r in allowed and r != ADMIN]
    needs = f"a {' or '.join(needed)} token (or an admin's)" if needed else "an admin token"
    has = ",".join(r for r in ROLES if r in held)
    return (f"{method} {path[:200]} needs {needs}; this token is a {has} token: give this client a token with "
            f"that role (lightning-rl store token --role {(needed or [ADMIN])[0]})")


__all__ = ["ADMIN", "READER", "RELOAD_EVERY", "ROLES", "ROUTE_ROLES", "RUNNER", "SCOPE_ROLES", "MintedToken",
           "RouteRoles", "Tokens", "check_roles", "mint_token", "parse_tokens", "queue_listing_refused", "refusal",
           "request_roles", "route_table", "token_digest"]
