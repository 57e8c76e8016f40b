"""HttpStore: the client of ``lightning-rl store serve``, used when ``LIGHTNING_RL_STORE=http://...``.

Writes (rollouts, spans, rewards, finishes) are the writer's ops (``store/ops.py``), queued to a
background writer that encodes them as the server's idempotent wire ops (``store/wire/``) and sends
them in batches, so a retried batch never duplicates anything.

**Several servers, one store.** ``HttpStore(["http://a:8765", "http://b:8765"])`` (or one string with
commas, as ``LIGHTNING_RL_STORE`` and every ``--store`` take it) talks to servers that serve one store
(``store serve --db postgresql://...`` on any machines). The rule, for every request (the background
batches and their replay, queries, the queue, late rewards, publishes): it goes to the server in use,
and when that one fails (connection refused or reset, a timeout, 5xx, 408, 429) to the next, in turn,
wrapping around; the first that answers is used from then on (a move is counted,
``store_server_failovers``, and logged once). Only when none answers does the client spill (writes) or
retry and then raise (the rest), as below. A 4xx answer is the request's fault, not the server's: it
is not tried elsewhere. A request a failed server may have carried out is sent again to the next,
which is safe because every one is idempotent in the store: rollouts by id, spans by
``(rollout_id, seq)``, rewards by uid (the client gives every reward one), a finish by the lifecycle
rules (a terminal state is final), a lease by its key (a retry gets the entries the first request
leased), a completion by its runner and outcome, an enqueue by its group id (the client makes one and
sends ``once``), a cancel by its ids (a try cancelled before is answered again), a publish by its served
name, version and time.

When no server can be reached (or answers 5xx) for about a second, the batch is appended to a
local spill file instead, and so is everything after it, in order, until a server answers again;
then the spill files are replayed, oldest first, before anything newer. The agent's only wait is
the flush at the end of its rollout, which returns once its records are on the server or in a spill
file: about a second per server at most, also when a server accepts connections and never answers
(writes and probes have short timeouts). ``complete`` waits for the backlog: a try's outcome never
reaches the server before the rollout it reports on. A batch the server refuses (4xx: a bug or bad
input, not an outage) is kept in a ``rejected-*`` file with the server's reason and reported; it is
never dropped silently.

Spill files live in ``LIGHTNING_RL_SPILL_DIR`` (default ``~/.cache/lightning-rl/spill/<host>_<port>``,
the servers' joined with ``+``). A process adopts the spill files of dead processes when it opens the
store, so a runner killed while the servers were down loses nothing that it had spilled.

Queries, late rewards and the task queue are plain requests, retried for ``retry_for`` seconds
when no server is reachable (a runner waits out a server restart) and then raised as
:class:`StoreError`. What the server has no route for (LLM call counts, the last activity) is read
through ``rollout_data`` and counted here (``store/scan.py``).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from ...errors import ConfigurationError, RolloutNotFoundError, StoreError
from ...records import Reward, RewardSource
from ...settings import Settings, spill_dir, store_token
from .. import checks, wire
from .queries import ServerQueries
from .server_queue import ServerQueue
from .writes import PROBE_EVERY, REPLAY, BatchSender, ServerList, _NoStoreServer, _Unreachable, server_urls
from ..erasure import erase_from_spill_files, erased, rollout_id_list
from ..kit.base import KitStore
from ..lifecycle import track
from ..spill import SpillFiles, rejected_files_in, spill_files_in
from ..writer import BackgroundWriter


def _default_spill_dir(urls: list[str]) -> Path:
    configured = spill_dir()
    if configured:
        return Path(configured)
    name = "+".join(sorted(f"{p.hostname}_{p.port or 80}" for p in map(urlsplit, urls)))
    if len(name) > 120:  # many servers: a name of their own, the same whatever their order
        name = "servers_" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "lightning-rl" / "spill" / name


class HttpStore(ServerQueries, ServerQueue, KitStore):
    """The client of store servers (every protocol of ``store/protocols.py``): ``url`` is one server, or
    several serving one store (a list, or one string with commas), to fail over (module doc). The sink
    funnel and ingest are the kit's (``kit/base.py``); what it writes is kept once sent or spilled. Its reads and
    policy log are ``queries.py``'s, its task queue ``server_queue.py``'s."""

    _confirmed_in_database = frozenset()

    def __init__(self, url: str | Sequence[str], *, token: str | None = None, timeout: float = 10.0,
                 retry_for: float = 60.0, spill_dir: str | os.PathLike[str] | None = None,
                 queue_size: int | None = None, batch_ops: int = wire.CLIENT_BATCH_OPS,
                 read_only: bool = False) -> None:
        urls = server_urls(url)
        self.url = ",".join(urls)  # what open_store takes back (worker processes reopen it so)
        token = token if token is not None else store_token()
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._timeout = httpx.Timeout(timeout, connect=min(timeout, 3.0))
        self._servers = ServerList(urls, headers=headers, timeout=self._timeout)
        self._retry_for = retry_for
        self._batch_ops = max(1, min(batch_ops, wire.MAX_BATCH_OPS))
        spill = SpillFiles(Path(spill_dir) if spill_dir else _default_spill_dir(urls))
        self._sender = BatchSender(self._servers, spill, batch_ops=self._batch_ops, timeout=self._timeout)
        self.read_only = read_only
        self._closed = False
        self._queue_size = queue_size or Settings.from_env().queue_size
        if read_only:  # the viewer, the doctor: no writer, and nobody's spill files are adopted or replayed
            self._writer = None
            return
        spill.adopt_orphans()
        self._start_threads()
        track(self)

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise checks.read_only(what, self.url)

    def _start_threads(self) -> None:
        self._writer = BackgroundWriter(self._sender.send, maxsize=self._queue_size,
                                        name=f"lightning-rl-http:{self.url}")
        self._stop = threading.Event()
        self._replayer = threading.Thread(target=self._poke_replay, name="lightning-rl-spill-replay", daemon=True)
        self._replayer.start()

    def _after_fork(self) -> None:
        """In a forked child: its own connections, threads and spill files (the parent keeps its own)."""
        self._servers = self._servers.renewed()
        self._sender = BatchSender(self._servers, SpillFiles(self._sender.spill.folder), batch_ops=self._batch_ops,
                                   timeout=self._timeout)
        self._start_threads()

    @property
    def latencies(self) -> list[float]:
        """Seconds per accepted batch request (bench and reliability figures)."""
        return self._sender.latencies

    def _poke_replay(self) -> None:
        """While there is a backlog, wake the writer now and then, so that it drains when the server
        returns even if this process writes nothing new."""
        while not self._stop.wait(2 * PROBE_EVERY):
            if self._sender.spill.files:
                try:
                    self._writer.put(REPLAY)
                except RuntimeError:
                    return  # closed

    def close(self) -> None:
        """Send what is queued, try once more to replay the backlog (whatever stays is adopted by
        the next process that opens this spill directory), and close."""
        if self._closed:
            return
        self._closed = True
        if self._writer is None:  # read-only
            self._servers.close()
            return
        self._stop.set()
        self._writer.close()
        if self._sender.spill.files:
            self._sender.replay(force=True)
        self._servers.close()

    @property
    def servers(self) -> list[str]:
        """The servers this client may use, the one in use first."""
        urls = self._servers.urls
        start = urls.index(self._servers.current)
        return urls[start:] + urls[:start]

    @property
    def spill_files(self) -> list[Path]:
        """Spill files waiting to be sent (read-only: every one in the folder, whoever owns it)."""
        if self.read_only:
            folder = self._sender.spill.folder
            return spill_files_in(folder)
        return list(self._sender.spill.files)

    @property
    def rejected_files(self) -> list[Path]:
        """Records a server refused (4xx) or JSON could not hold, kept with the reason; never replayed."""
        return rejected_files_in(self._sender.spill.folder)

    # -- requests ----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                 not_found_ok: bool = False, older: str | None = None) -> Any:
        """One request to a server that answers (the one in use, then the others: module doc), retried for
        ``retry_for`` seconds while none does. ``older``: the error for a store server that lacks ``path``."""
        deadline = time.monotonic() + self._retry_for
        delay = 0.05
        body = orjson.dumps(json) if json is not None else None
        params = {k: v for k, v in (params or {}).items() if v is not None}
        while True:
            try:
                resp = self._servers.send(method, path, content=body, params=params)
            except _NoStoreServer as exc:  # a wrong URL does not become a store server by waiting
                if older is not None and path != "/health" and self._request("GET", "/health", not_found_ok=True):
                    raise StoreError(older) from None  # a store server, from before this route
                raise ConfigurationError(f"{exc}; give the URL of `lightning-rl store serve` (http://HOST:PORT, "
                                         "no path), e.g. --store http://127.0.0.1:8765") from None
            except _Unreachable as exc:
                problem = str(exc)
            else:
                if resp.status_code < 300:
                    return orjson.loads(resp.content)
                if resp.status_code == 404 and not_found_ok:
                    return None
                _raise_for(resp, self._servers.current)
            if time.monotonic() >= deadline:
                which = (f"the store server {self.url} did not answer" if len(self._servers.urls) == 1 else
                         f"none of the store servers {self.url} answered")
                raise StoreError(f"{which} {method} {path} in {self._retry_for:.0f} s of trying ({problem[:1000]}); "
                                 "is `lightning-rl store serve` running there?")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    # -- erasure ------------------------------------------------------------------------------------
    def delete_rollouts(self, rollout_ids: Iterable[str], *, full: bool = False) -> int:
        """What this process still holds for them goes first (sent, or its lines taken out of the spill
        files), then the server erases them from its store (``POST /v1/rollouts/delete``, 1000 ids a request)."""
        ids = rollout_id_list(rollout_ids)
        self._writable("delete_rollouts")
        if not ids:
            return 0
        self.flush()
        with self._sender.spill.lock:
            erase_from_spill_files(self._sender.spill, ids)
        removed = 0
        for start in range(0, len(ids), 1000):
            removed += self._delete(ids[start:start + 1000], full)
        return erased(removed)

    def _delete(self, ids: list[str], full: bool) -> int:
        older = (f"the store server {self.url} has no erasure endpoint (POST {wire.API_PREFIX}/rollouts/delete): it "
                 "runs a lightning-rl older than this client. Upgrade lightning-rl where it runs (pip install -U "
                 "lightning-rl) and restart `lightning-rl store serve`, or erase on the store itself: lightning-rl "
                 "store prune --store DB")
        return wire.Deleted.model_validate(self._request(
            "POST", "/rollouts/delete", json={"rollout_ids": ids, "full": full}, older=older)).deleted

    # -- RewardLog ----------------------------------------------------------------------------------
    def add_reward(self, rollout_id: str, value: float, name: str = "reward", *, llm_call_index: int | None = None,
                   agent: str | None = None, source: str | RewardSource = RewardSource.FEEDBACK,
                   uid: str | None = None) -> Reward:
        """Durable on the server on return (the server checks it again, with the same words)."""
        self._writable("add_reward")
        reward = checks.new_reward(rollout_id, value, name, llm_call_index=llm_call_index, agent=agent, source=source,
                                   uid=uid)
        self.flush()  # a rollout that just finished in this process must be there
        # the server answers 404 for an unknown rollout (no read first: a runner's token may not read rollouts)
        written = self._request("POST", "/rewards", not_found_ok=True, json=dict(
            rollout_id=reward.rollout_id, value=reward.value, name=reward.name, llm_call_index=reward.llm_call_index,
            agent=reward.agent, source=reward.source.value, uid=reward.uid))
        if written is None:
            raise checks.not_found(rollout_id, self.url)
        return reward

    def rewarded_since(self, after: int = 0, *, name: str | None = None, limit: int = 10_000) -> tuple[list[str], int]:
        checks.check_position(after)
        checks.check_count(limit, "limit")
        self.flush()
        data = wire.RewardedSince.model_validate(
            self._request("GET", "/rewards", params=dict(after=after, name=name, limit=limit)))
        return data.rollout_ids, data.position

def _raise_for(resp: httpx.Response, url: str) -> None:
    try:
        detail = orjson.loads(resp.content)
        message = detail.get("error", "") + ("; " + "; ".join(detail["details"]) if detail.get("details") else "")
    except (orjson.JSONDecodeError, AttributeError, TypeError):
        message = resp.text[:500]
    if resp.status_code == 404:
        raise RolloutNotFoundError(message)
    if resp.status_code == 401:
        raise ConfigurationError(f"the store server {url} refused the token: {message}")
    if resp.status_code == 403:  # the token's role does not cover this request: waiting will not change that
        raise ConfigurationError(f"the store server {url} refused this token the request (HTTP 403): {message}")
    raise ConfigurationError(f"the store server {url} refused the request (HTTP {resp.status_code}): {message}")
