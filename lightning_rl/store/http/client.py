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
sends ``once``), a publish by its served name, version and time.

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

import datetime as dt
import hashlib
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import httpx
import orjson

from ...errors import ConfigurationError, RolloutNotFoundError, StoreError, TaskNotSerializableError
from ...records import (
    PolicyDecision,
    PolicyRecord,
    QuarantinedRecord,
    QueueEntry,
    Reward,
    RewardSource,
    Rollout,
    RolloutPage,
    RolloutQuery,
    RolloutStatus,
    Span,
)
from ...settings import Settings, spill_dir, store_token
from .. import checks, scan, wire
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


class HttpStore(KitStore):
    """The client of store servers (every protocol of ``store/protocols.py``): ``url`` is one server, or
    several serving one store (a list, or one string with commas), to fail over (module doc). The sink
    funnel and ingest are the kit's (``kit/base.py``); what it writes is kept once sent or spilled."""

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

    # -- RolloutReader ------------------------------------------------------------------------------
    def get_rollout(self, rollout_id: str) -> Rollout:
        data = self._request("GET", f"/rollouts/{_quote(rollout_id)}", not_found_ok=True)
        if data is None:
            raise checks.not_found(rollout_id, self.url)
        return Rollout.model_validate(data)

    def rollouts(self, *, mode: str | None = None, status: str | RolloutStatus | None = None,
                 since: float | dt.datetime | None = None, min_policy_version: int | None = None,
                 limit: int | None = None, newest_first: bool = False) -> list[Rollout]:
        mode, status, since = checks.rollout_filters(mode, status, since, min_policy_version, limit)
        data = self._request("GET", "/rollouts", params=dict(
            mode=mode, status=status, since=since, min_policy_version=min_policy_version, limit=limit,
            newest_first="true" if newest_first else None))
        return wire.ROLLOUTS.validate_python(data)

    def rollout_page(self, query: RolloutQuery | None = None, **filters: Any) -> RolloutPage:
        query = checks.rollout_query(query, filters)
        return RolloutPage.model_validate(self._request("POST", "/rollouts/page", json=query.model_dump(mode="json")))

    def spans(self, rollout_id: str) -> list[Span]:
        data = self._request("GET", f"/rollouts/{_quote(rollout_id)}/spans", not_found_ok=True)
        if data is None:
            raise checks.not_found(rollout_id, self.url)
        return wire.SPANS.validate_python(data)

    def rewards(self, rollout_id: str) -> list[Reward]:
        data = self._request("GET", f"/rollouts/{_quote(rollout_id)}/rewards", not_found_ok=True)
        if data is None:
            raise checks.not_found(rollout_id, self.url)
        return wire.REWARDS.validate_python(data)

    def rollout_data(self, rollout_ids: Sequence[str]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
        """Asked for in batches of 200 (one request each)."""
        ids = list(rollout_ids)
        for start in range(0, len(ids), 200):
            data = self._request("POST", "/rollout_data", json={"rollout_ids": ids[start:start + 200]})
            for item in wire.ROLLOUT_DATA.validate_python(data):
                yield item.rollout, item.spans, item.rewards

    # -- RolloutIndex -------------------------------------------------------------------------------
    def existing_rollout_ids(self, rollout_ids: Iterable[str]) -> set[str]:
        return {rid for rid in rollout_ids
                if self._request("GET", f"/rollouts/{_quote(rid)}", not_found_ok=True) is not None}

    def rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        return self._request("GET", "/rollout_ids", params={"prefix": prefix, "limit": limit})

    def llm_call_counts(self, rollout_ids: Sequence[str]) -> dict[str, int]:
        return scan.llm_call_counts(self, rollout_ids)

    def last_activity(self, rollout_id: str) -> float | None:
        try:
            ((_, spans, rewards),) = self.rollout_data([rollout_id])
        except RolloutNotFoundError:  # nothing reached a rollout that is not there
            return None
        return scan.last_activity(spans, rewards)

    def quarantined(self, *, limit: int = 1000) -> list[QuarantinedRecord]:
        checks.check_count(limit, "limit")
        return [QuarantinedRecord.model_validate(q) for q in self._request("GET", "/quarantine", params={"limit": limit})]

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

    # -- PolicyLog ----------------------------------------------------------------------------------
    def record_policy(self, served_name: str, version: int, *, adapter: str | None = None,
                      time: float | None = None, trained_on: Sequence[str] | None = None,
                      served_as: str | None = None) -> PolicyRecord:
        record = checks.policy_record(served_name, version, adapter=adapter, time=time, trained_on=trained_on,
                                      served_as=served_as)
        # served_as only when set: a store server from before it takes the publish as it was
        self._request("POST", "/policies", json=record.model_dump(
            mode="json", exclude={"schema_version"} | ({"served_as"} if record.served_as is None else set())))
        return record

    def policies(self, served_name: str | None = None) -> list[PolicyRecord]:
        return [PolicyRecord.model_validate(x) for x in self._request("GET", "/policies",
                                                                      params=dict(served_name=served_name))]

    def latest_policies(self) -> dict[str, PolicyRecord]:
        found = [PolicyRecord.model_validate(x) for x in self._request("GET", "/policies", params=dict(latest="true"))]
        return {p.served_name: p for p in found}

    def record_decision(self, served_name: str, version: int, decision: str, *, live_version: int | None = None,
                        adapter: str | None = None, figures: Mapping[str, Any] | None = None,
                        reason: str | None = None, time: float | None = None) -> PolicyDecision:
        record = checks.decision_record(served_name, version, decision, live_version=live_version, adapter=adapter,
                                        figures=figures, reason=reason, time=time)
        self._request("POST", "/decisions", json=record.model_dump(mode="json", exclude={"schema_version"}),
                      older=self._older_decisions())
        return record

    def decisions(self, served_name: str | None = None) -> list[PolicyDecision]:
        return [PolicyDecision.model_validate(x) for x in self._request(
            "GET", "/decisions", params=dict(served_name=served_name), older=self._older_decisions())]

    def latest_decisions(self) -> dict[str, PolicyDecision]:
        found = [PolicyDecision.model_validate(x) for x in self._request(
            "GET", "/decisions", params=dict(latest="true"), older=self._older_decisions())]
        return {d.served_name: d for d in found}

    def _older_decisions(self) -> str:
        return (f"the store server {self.url} has no policy decisions endpoint ({wire.API_PREFIX}/decisions): it runs "
                "a lightning-rl older than this client. Upgrade lightning-rl where it runs (pip install -U "
                "lightning-rl) and restart `lightning-rl store serve`")

    # -- TaskQueue (the server's) -------------------------------------------------------------------
    def enqueue(self, task: Any, *, n: int = 1, mode: str = "train", max_tries: int = 3,
                group_id: str | None = None, once: bool = False,
                overrides: Mapping[str, Any] | None = None) -> list[QueueEntry]:
        """Without a ``group_id`` the client makes one and sends the request with ``once``, so that a retry
        after a lost answer does not queue the task twice."""
        try:
            orjson.dumps(task)
        except TypeError as exc:
            raise TaskNotSerializableError(f"task {task!r:.80} cannot be sent to the store server as JSON ({exc}); "
                                           "use dicts, lists, strings and numbers") from None
        if group_id is None:
            group_id, once = uuid.uuid4().hex, True
        body = dict(task=task, n=n, mode=mode, max_tries=max_tries, group_id=group_id, once=once)
        if overrides is not None:  # sent only when given: a store server older than overrides takes the rest
            body["overrides"] = checks.check_overrides(overrides)
        data = self._request("POST", "/queue/enqueue", json=body)
        return wire.QUEUE_ENTRIES.validate_python(data)

    def lease(self, runner: str, *, lease_seconds: float = 60.0, limit: int = 1,
              key: str | None = None, wait: float = 0.0) -> list[QueueEntry]:
        """Every call carries a key (a fresh one unless given), which its retries reuse, so an answer lost
        on the way back (a server killed after its commit) strands nothing. ``wait``: the server holds the
        request until a try can be leased (on its clock, not this machine's), each request at most
        ``wire.MAX_LEASE_WAIT`` seconds and under this client's timeout; longer waits are several requests."""
        from ..task_queue import check_lease, check_wait

        check_lease(lease_seconds, limit)
        deadline = time.monotonic() + check_wait(wait)
        key = key or uuid.uuid4().hex
        self.flush()  # an expired try is marked timed_out by the server; our own records go first
        while True:
            left = deadline - time.monotonic()
            body: dict[str, Any] = dict(runner=runner, lease_seconds=lease_seconds, limit=limit, key=key)
            if left > 0:  # sent only when waiting: a store server from before long polls takes the rest
                body["wait"] = round(min(left, wire.MAX_LEASE_WAIT, max(self._timeout.read - 2.0, 0.5)), 3)
            entries = wire.QUEUE_ENTRIES.validate_python(self._request("POST", "/queue/lease", json=body))
            if entries or deadline - time.monotonic() <= 0:
                return entries

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0) -> bool:
        return self._request("POST", "/queue/heartbeat",
                             json=dict(queue_id=queue_id, runner=runner, lease_seconds=lease_seconds))["ok"]

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str) -> bool:
        """Once this process's records are on the server: an outcome never overtakes the rollout it reports
        on. While a spilled backlog cannot be written back (for ``retry_for`` seconds) it raises
        :class:`StoreError`, and the try's lease runs on."""
        self._drain(self._retry_for)
        return self._request("POST", "/queue/complete",
                             json=dict(queue_id=queue_id, runner=runner, outcome=RolloutStatus(outcome).value))["ok"]

    def _drain(self, timeout: float) -> None:
        """Wait until everything written so far is on the server, spilled backlog included."""
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        while self._sender.spill.files:
            if time.monotonic() >= deadline:
                raise StoreError(f"{len(self._sender.spill.files)} spill file(s) of this process are not on the store server "
                                 f"{self.url} yet; an outcome is only recorded after the records it reports on")
            try:
                self._writer.put(REPLAY)
            except RuntimeError:  # closed
                break
            self.flush(max(0.0, deadline - time.monotonic()))
            if self._sender.spill.files:
                time.sleep(0.1)

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]:
        data = self._request("POST", "/queue/entries", json={"group_ids": list(group_ids) if group_ids is not None else None})
        return wire.QUEUE_ENTRIES.validate_python(data)

    def expire_rollout(self, entry: QueueEntry, reason: str) -> None:
        """A plain finish: the server's queue keeps the rollouts of tries it expired itself final."""
        self.finish_rollout(entry.rollout_id, RolloutStatus.TIMED_OUT, time.time(), reason)


def _quote(rollout_id: str) -> str:
    return quote(rollout_id, safe="")


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
