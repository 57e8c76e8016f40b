"""HttpStore: the client of ``lightning-rl store serve``, used when ``LIGHTNING_RL_STORE=http://...``.

Writes (rollouts, spans, rewards, finishes) go through a background writer that sends them as
batches of idempotent ops (``store/wire.py``), so a retried batch never duplicates anything.

When the server cannot be reached (or answers 5xx) for about a second, the batch is appended to a
local spill file instead, and so is everything after it, in order, until the server answers again;
then the spill files are replayed, oldest first, before anything newer. The agent's only wait is
the flush at the end of its rollout, which returns once its records are on the server or in a spill
file: about a second at most, also when the server accepts connections and never answers (writes
and probes have short timeouts). ``complete`` waits for the backlog: a try's outcome never reaches
the server before the rollout it reports on. A batch the server refuses (4xx: a bug or bad input, not an outage) is kept in a
``rejected-*`` file with the server's reason and reported; it is never dropped silently.

Spill files live in ``LIGHTNING_RL_SPILL_DIR`` (default ``~/.cache/lightning-rl/spill/<host>_<port>``).
A process adopts the spill files of dead processes when it opens the store, so a runner killed while
the server was down loses nothing that it had spilled.

Queries, late rewards and the task queue are plain requests, retried for ``retry_for`` seconds
when the server is unreachable (a runner waits out a server restart) and then raised as
:class:`StoreError`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson

from ..boundaries import safe_text
from ..diagnostics import count, report_failure
from ..errors import ConfigurationError, RolloutNotFoundError, StoreError, TaskNotSerializableError
from ..records import (PolicyRecord, QuarantinedRecord, QueueEntry, QueueStatus, Reward, Rollout, RolloutPage,
                       RolloutQuery, RolloutStatus, Span, SpanRow)
from ..settings import ENV_SPILL_DIR, ENV_STORE_TOKEN, Settings
from . import wire
from .base import Store, check_count, check_position
from .lifecycle import track
from .spill import SpillFiles
from .writer import BackgroundWriter

_RETRY_DELAYS = (0.05, 0.2, 0.5)  # a batch is spilled after these (about 0.75 s of trying)
_PROBE_EVERY = 0.5  # while spilling, the server is tried again at most this often
# A write the agent may be waiting for (its rollout's flush) gets about a second in all, also when
# the server accepts connections and never answers; so does a probe of a server that was away.
_WRITE_BUDGET = 1.0
_QUICK = httpx.Timeout(1.0, connect=0.5)
_PROBE = httpx.Timeout(0.5, connect=0.5)
_BATCH_BYTES = 8 * 2**20


class _Unreachable(Exception):
    """The server did not answer (connection refused, timeout, 5xx): spill and retry later."""


class _Rejected(Exception):
    """The server refused the content (4xx): keep it aside with the reason; retrying cannot help."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.invalid_ops: list[int] | None = None  # the ops the server named (a refused batch), if it did
        try:
            named = orjson.loads(body).get("invalid_ops")
        except (orjson.JSONDecodeError, AttributeError):
            named = None
        if isinstance(named, list) and named and all(isinstance(i, int) and not isinstance(i, bool) for i in named):
            self.invalid_ops = named


def _default_spill_dir(url: str) -> Path:
    configured = os.environ.get(ENV_SPILL_DIR)
    if configured:
        return Path(configured)
    parts = urlsplit(url)
    return Path.home() / ".cache" / "lightning-rl" / "spill" / f"{parts.hostname}_{parts.port or 80}"


class HttpStore(Store):
    def __init__(self, url: str, *, token: str | None = None, timeout: float = 10.0, retry_for: float = 60.0,
                 spill_dir: str | os.PathLike[str] | None = None, queue_size: int | None = None,
                 batch_ops: int = wire.CLIENT_BATCH_OPS, read_only: bool = False) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(f"store URL {url!r} is not an http(s)://host:port URL of `lightning-rl store serve`")
        self.url = url.rstrip("/")
        token = token if token is not None else os.environ.get(ENV_STORE_TOKEN)
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._timeout = httpx.Timeout(timeout, connect=min(timeout, 3.0))
        self._client_args = dict(base_url=self.url + wire.API_PREFIX, headers=headers, timeout=self._timeout)
        self._client = httpx.Client(**self._client_args)
        self._retry_for = retry_for
        self._batch_ops = max(1, min(batch_ops, wire.MAX_BATCH_OPS))
        self._spill = SpillFiles(Path(spill_dir) if spill_dir else _default_spill_dir(self.url))
        self.read_only = read_only
        self._closed = False
        self.latencies: list[float] = []  # seconds per accepted batch request (bench and reliability figures)
        self._lat_lock = threading.Lock()
        self._queue_size = queue_size or Settings.from_env().queue_size
        if read_only:  # the viewer: no writer, and nobody's spill files are adopted or replayed
            self._writer = None
            return
        self._spill.adopt_orphans()
        self._start_threads()
        track(self)

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise StoreError(f"{what}: the store {self.url} was opened read-only (the viewer's mode); open it with "
                             "open_store(url) to write")

    def _start_threads(self) -> None:
        self._writer = BackgroundWriter(self._send, maxsize=self._queue_size, name=f"lightning-rl-http:{self.url}")
        self._stop = threading.Event()
        self._replayer = threading.Thread(target=self._poke_replay, name="lightning-rl-spill-replay", daemon=True)
        self._replayer.start()

    def _after_fork(self) -> None:
        """In a forked child: its own connections, threads and spill files (the parent keeps its own)."""
        self._client = httpx.Client(**self._client_args)
        self._spill = SpillFiles(self._spill.folder)
        self.latencies = []
        self._lat_lock = threading.Lock()
        self._start_threads()

    # -- sink ------------------------------------------------------------------------------------
    def start_rollout(self, rollout: Rollout) -> None:
        self._writable("start_rollout")
        self._writer.put("rollout", rollout)  # encoded on the writer thread, as every op

    def write_span(self, row: SpanRow) -> None:
        self._writable("write_span")
        self._writer.put("span", row)  # encoded on the writer thread, off the agent's path

    def write_reward(self, reward: Reward) -> None:
        self._writable("write_reward")
        self._writer.put("reward", reward)

    def finish_rollout(self, rollout_id: str, status: RolloutStatus, end_time: float, error: str | None,
                       policy_version: int | None = None) -> None:
        self._writable("finish_rollout")
        self._writer.put("finish", (rollout_id, status, end_time, error, policy_version))

    def flush(self, timeout: float | None = None) -> bool:
        if self._closed or self._writer is None:
            return True
        return self._writer.flush(timeout)

    def close(self) -> None:
        """Send what is queued, try once more to replay the backlog (whatever stays is adopted by
        the next process that opens this spill directory), and close."""
        if self._closed:
            return
        self._closed = True
        if self._writer is None:  # read-only
            self._client.close()
            return
        self._stop.set()
        self._writer.close()
        if self._spill.files:
            self._replay(force=True)
        self._client.close()

    @property
    def spill_files(self) -> list[Path]:
        return list(self._spill.files)

    # -- the writer thread -------------------------------------------------------------------------
    def _poke_replay(self) -> None:
        """While there is a backlog, wake the writer now and then, so that it drains when the server
        returns even if this process writes nothing new."""
        while not self._stop.wait(2 * _PROBE_EVERY):
            if self._spill.files:
                try:
                    self._writer.put("replay", None)
                except RuntimeError:
                    return  # closed

    def _send(self, items: list[tuple[str, Any]]) -> None:
        """Send one writer batch, or spill it. Never raises: every op ends on the server or on disk (a
        record that cannot even be encoded is kept in a ``rejected-*`` file with the reason)."""
        ops = []
        for kind, payload in items:
            if kind == "replay":
                continue
            try:
                ops.append(_ENCODERS[kind](payload))
            except Exception as exc:  # JSON cannot hold it: set aside, described, never retried
                self._set_aside([orjson.dumps({"op": kind, "unencodable": safe_text(payload)})],
                                f"{kind} could not be encoded: {type(exc).__name__}: {exc}")
        if self._spill.files and not self._replay():
            if ops:
                self._spill.append(ops)
            return
        for start in range(0, len(ops), self._batch_ops):
            chunk = ops[start:start + self._batch_ops]
            try:
                self._post_ops(chunk)
            except _Unreachable as exc:
                self._spill.last_failure = time.monotonic()
                report_failure("store server unreachable", message=f"lightning-rl: store server {self.url} "
                               f"unreachable ({exc}); spilling to {self._spill.folder} (replayed when it returns)")
                self._spill.append(ops[start:])
                return

    def _replay(self, force: bool = False) -> bool:
        """Send the spill files, oldest first. True when none is left. The first request is a short
        probe; once the server has answered, the rest go with the normal timeout."""
        if not force and time.monotonic() - self._spill.last_failure < _PROBE_EVERY:
            return False
        timeout, budget = _PROBE, 0.0
        while self._spill.files:
            path = self._spill.files[0]
            try:
                ops = SpillFiles.read(path)
                for start in range(0, len(ops), self._batch_ops):
                    self._post_ops(ops[start:start + self._batch_ops], timeout=timeout, budget=budget)
                    timeout, budget = self._timeout, _WRITE_BUDGET
            except _Unreachable:
                self._spill.last_failure = time.monotonic()
                return False
            except OSError as exc:
                report_failure("spill replay", exc)
                self._spill.last_failure = time.monotonic()
                return False
            path.unlink()
            self._spill.files.pop(0)
            count("spill_files_replayed")
        return True

    def _post_ops(self, ops: list[bytes], *, timeout: httpx.Timeout = _QUICK, budget: float = _WRITE_BUDGET) -> None:
        """POST ops as batches under the size bound; 4xx batches are set aside (split first if 413)."""
        batches, current, size = [], [], 0
        for op in ops:
            if current and size + len(op) > _BATCH_BYTES:
                batches.append(current)
                current, size = [], 0
            current.append(op)
            size += len(op) + 1
        if current:
            batches.append(current)
        for batch in batches:
            try:
                self._post_batch(batch, timeout=timeout, budget=budget)
            except _Rejected as exc:
                named = [i for i in exc.invalid_ops or () if 0 <= i < len(batch)]
                if named and len(named) < len(batch):  # set aside the ops the server named; send the rest again
                    self._set_aside([batch[i] for i in named], str(exc))
                    bad = set(named)
                    self._post_ops([op for i, op in enumerate(batch) if i not in bad], timeout=timeout, budget=budget)
                    continue
                if exc.status in (413, 422) and len(batch) > 1:  # too big, or the server did not say which op
                    half = len(batch) // 2
                    self._post_ops(batch[:half], timeout=timeout, budget=budget)
                    self._post_ops(batch[half:], timeout=timeout, budget=budget)
                    continue
                self._set_aside(batch, str(exc))

    def _set_aside(self, ops: list[bytes], reason: str) -> None:
        """Ops the server refused (or that cannot be encoded) in a ``rejected-*`` file with the reason."""
        where = self._spill.reject(ops, reason)
        report_failure("store server refused a batch", message=(
            f"lightning-rl: the store server refused {len(ops)} records ({reason[:500]}); kept in {where}, "
            "the rest of their batch was sent (logged once; counted as rejected_ops)"))

    def _post_batch(self, ops: list[bytes], *, timeout: httpx.Timeout, budget: float) -> None:
        """POST one batch, retrying within ``budget`` seconds (each request under ``timeout``)."""
        body = wire.batch_body(ops)
        last: Exception | None = None
        deadline = time.monotonic() + budget
        for delay in (*_RETRY_DELAYS, None):
            t0 = time.perf_counter()
            try:
                resp = self._client.post("/batch", content=body, timeout=timeout)
            except httpx.HTTPError as exc:
                last = exc
            else:
                if resp.status_code < 300:
                    with self._lat_lock:
                        self.latencies.append(time.perf_counter() - t0)
                    return
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise _Rejected(resp.status_code, resp.text[:2000])
                last = StoreError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            if delay is None or time.monotonic() + delay >= deadline:
                break
            time.sleep(delay)
        raise _Unreachable(f"{type(last).__name__}: {last}")

    # -- requests ----------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                 not_found_ok: bool = False) -> Any:
        deadline = time.monotonic() + self._retry_for
        delay = 0.05
        body = orjson.dumps(json) if json is not None else None
        while True:
            try:
                resp = self._client.request(method, path, content=body,
                                            params={k: v for k, v in (params or {}).items() if v is not None})
            except httpx.HTTPError as exc:
                problem: str = f"{type(exc).__name__}: {exc}"
            else:
                if resp.status_code < 300:
                    return orjson.loads(resp.content)
                if resp.status_code == 404 and not_found_ok:
                    return None
                if resp.status_code < 500 and resp.status_code not in (408, 429):
                    _raise_for(resp, self.url)
                problem = f"HTTP {resp.status_code}"
            if time.monotonic() >= deadline:
                raise StoreError(f"store server {self.url} did not answer {method} {path} for {self._retry_for:.0f} s "
                                 f"({problem}); is `lightning-rl store serve` running there?")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _get_rollout(self, rollout_id: str) -> Rollout | None:
        data = self._request("GET", f"/rollouts/{_quote(rollout_id)}", not_found_ok=True)
        return None if data is None else Rollout.model_validate(data)

    def _query_rollouts(self, *, mode, status, since, min_policy_version, limit, newest_first) -> list[Rollout]:
        data = self._request("GET", "/rollouts", params=dict(
            mode=mode, status=status, since=since, min_policy_version=min_policy_version, limit=limit,
            newest_first="true" if newest_first else None))
        return wire.ROLLOUTS.validate_python(data)

    def _rollout_page(self, query: RolloutQuery) -> RolloutPage:
        return RolloutPage.model_validate(self._request("POST", "/rollouts/page", json=query.model_dump(mode="json")))

    def _get_spans(self, rollout_id: str) -> list[Span]:
        return wire.SPANS.validate_python(self._request("GET", f"/rollouts/{_quote(rollout_id)}/spans"))

    def _get_rewards(self, rollout_id: str) -> list[Reward]:
        return wire.REWARDS.validate_python(self._request("GET", f"/rollouts/{_quote(rollout_id)}/rewards"))

    def _rollout_ids_with_prefix(self, prefix: str, limit: int) -> list[str]:
        return self._request("GET", "/rollout_ids", params={"prefix": prefix, "limit": limit})

    def _quarantined(self, limit: int) -> list[QuarantinedRecord]:
        return [QuarantinedRecord.model_validate(q) for q in self._request("GET", "/quarantine", params={"limit": limit})]

    def _rewards_after(self, after: int, name: str | None, limit: int) -> list[tuple[int, str]]:
        raise NotImplementedError  # rewarded_since is one request

    def rewarded_since(self, after: int = 0, *, name: str | None = None, limit: int = 10_000) -> tuple[list[str], int]:
        check_position(after)
        check_count(limit, "limit")
        self.flush()
        data = wire.RewardedSince.model_validate(
            self._request("GET", "/rewards", params=dict(after=after, name=name, limit=limit)))
        return data.rollout_ids, data.position

    def _insert_policy(self, record: PolicyRecord) -> None:
        # trained_on only when recorded: a store server from before lineage refuses the key.
        skip = {"schema_version"} | (set() if record.trained_on is not None else {"trained_on"})
        self._request("POST", "/policies", json=record.model_dump(mode="json", exclude=skip))

    def _query_policies(self, served_name: str | None, latest: bool = False) -> list[PolicyRecord]:
        data = self._request("GET", "/policies", params=dict(served_name=served_name, latest="true" if latest else None))
        return [PolicyRecord.model_validate(x) for x in data]

    def _insert_reward(self, reward: Reward) -> None:
        self._request("POST", "/rewards", json=dict(
            rollout_id=reward.rollout_id, value=reward.value, name=reward.name, llm_call_index=reward.llm_call_index,
            agent=reward.agent, source=reward.source.value, uid=reward.uid))

    def _with_data(self, rollouts: Iterable[Rollout]) -> Iterator[tuple[Rollout, list[Span], list[Reward]]]:
        rollouts = list(rollouts)
        for start in range(0, len(rollouts), 200):
            ids = [r.rollout_id for r in rollouts[start:start + 200]]
            for item in wire.ROLLOUT_DATA.validate_python(self._request("POST", "/rollout_data", json={"rollout_ids": ids})):
                yield item.rollout, item.spans, item.rewards

    def existing_rollout_ids(self, rollout_ids: Iterable[str]) -> set[str]:
        return {rid for rid in rollout_ids if self._get_rollout(rid) is not None}

    def add_spans(self, spans: list[Span]) -> None:
        """Ingest spans recorded elsewhere, after everything written before; on the server (or in a
        spill file) on return."""
        self._writable("add_spans")
        self._writer.put_many([("op", orjson.dumps({"op": "span", "span": s.model_dump(mode="json")})) for s in spans])
        if not self.flush(Settings.from_env().flush_timeout):
            raise StoreError(f"{len(spans)} spans are queued but were not sent to {self.url} in time")

    # -- the task queue ------------------------------------------------------------------------------
    def enqueue(self, task: Any, *, n: int = 1, mode: str = "train", max_tries: int = 3,
                group_id: str | None = None, once: bool = False) -> list[QueueEntry]:
        """As :meth:`Store.enqueue`. Without a ``group_id`` the client makes one and sends the request
        with ``once``, so that a retry after a lost answer does not queue the task twice."""
        try:
            orjson.dumps(task)
        except TypeError as exc:
            raise TaskNotSerializableError(f"task {task!r:.80} cannot be sent to the store server as JSON ({exc}); "
                                           "use dicts, lists, strings and numbers") from None
        if group_id is None:
            group_id, once = uuid.uuid4().hex, True
        data = self._request("POST", "/queue/enqueue", json=dict(task=task, n=n, mode=mode, max_tries=max_tries,
                                                                 group_id=group_id, once=once))
        return wire.QUEUE_ENTRIES.validate_python(data)

    def lease(self, runner: str, *, lease_seconds: float = 60.0, limit: int = 1,
              key: str | None = None) -> list[QueueEntry]:
        """As :meth:`Store.lease`; every call carries a key (a fresh one unless given), which its retries
        reuse, so an answer lost on the way back (a server killed after its commit) strands nothing."""
        self.flush()  # an expired try is marked timed_out by the server; our own records go first
        data = self._request("POST", "/queue/lease", json=dict(runner=runner, lease_seconds=lease_seconds, limit=limit,
                                                               key=key or uuid.uuid4().hex))
        return wire.QUEUE_ENTRIES.validate_python(data)

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0) -> bool:
        return self._request("POST", "/queue/heartbeat",
                             json=dict(queue_id=queue_id, runner=runner, lease_seconds=lease_seconds))["ok"]

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str) -> bool:
        """As :meth:`Store.complete`, once this process's records are on the server: an outcome never
        overtakes the rollout it reports on. While a spilled backlog cannot be written back (for
        ``retry_for`` seconds) it raises :class:`StoreError`, and the try's lease runs on."""
        self._drain(self._retry_for)
        return self._request("POST", "/queue/complete",
                             json=dict(queue_id=queue_id, runner=runner, outcome=RolloutStatus(outcome).value))["ok"]

    def _drain(self, timeout: float) -> None:
        """Wait until everything written so far is on the server, spilled backlog included."""
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        while self._spill.files:
            if time.monotonic() >= deadline:
                raise StoreError(f"{len(self._spill.files)} spill file(s) of this process are not on the store server "
                                 f"{self.url} yet; an outcome is only recorded after the records it reports on")
            try:
                self._writer.put("replay", None)
            except RuntimeError:  # closed
                break
            self.flush(max(0.0, deadline - time.monotonic()))
            if self._spill.files:
                time.sleep(0.1)

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]:
        data = self._request("POST", "/queue/entries", json={"group_ids": list(group_ids) if group_ids is not None else None})
        return wire.QUEUE_ENTRIES.validate_python(data)

    def wait_for_groups(self, group_ids: Sequence[str], *, timeout: float | None = None) -> bool:
        from .task_queue import wait_until

        def pending() -> int:
            return sum(1 for e in self.queue_entries(group_ids) if e.status != QueueStatus.DONE)

        return wait_until(pending, lambda n: n == 0, timeout, poll=0.2) == 0

    def _queue_txn(self, fn):
        raise NotImplementedError("the task queue of an HttpStore runs on the server")


#: How the writer thread encodes each kind of item as a wire op (``op``: encoded already).
_ENCODERS = {
    "op": lambda payload: payload,
    "span": wire.encode_span,
    "rollout": wire.encode_rollout,
    "reward": wire.encode_reward,
    "finish": lambda payload: wire.encode_finish(*payload),
}


def _quote(rollout_id: str) -> str:
    from urllib.parse import quote

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
    raise ConfigurationError(f"the store server {url} refused the request (HTTP {resp.status_code}): {message}")
