"""The task queue of an ``HttpStore``: the store server's queue, over requests that a retry cannot repeat
(a group id sent ``once``, a lease key), and a completion sent only once this process's records are on the
server (``ServerQueue``, a base class of ``HttpStore``, ``client.py``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson

from ...errors import StoreError, TaskNotSerializableError
from ...records import QueueEntry, RolloutStatus
from .. import checks, wire
from .writes import REPLAY


class ServerQueue:
    """The ``TaskQueue`` of ``HttpStore`` (``client.py``), over its ``_request``, writer and spill files."""

    url: str
    _request: Callable[..., Any]

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

    def heartbeat(self, queue_id: str, runner: str, *, lease_seconds: float = 60.0,
                  rollout_id: str | None = None) -> bool:
        body = dict(queue_id=queue_id, runner=runner, lease_seconds=lease_seconds)
        if rollout_id is not None:  # sent only when given: an older server takes the rest
            body["rollout_id"] = rollout_id
        return self._request("POST", "/queue/heartbeat", json=body)["ok"]

    def complete(self, queue_id: str, runner: str, outcome: RolloutStatus | str, *,
                 rollout_id: str | None = None) -> bool:
        """Once this process's records are on the server: an outcome never overtakes the rollout it reports
        on. While a spilled backlog cannot be written back (for ``retry_for`` seconds) it raises
        :class:`StoreError`, and the try's lease runs on."""
        self._drain(self._retry_for)
        body = dict(queue_id=queue_id, runner=runner, outcome=RolloutStatus(outcome).value)
        if rollout_id is not None:
            body["rollout_id"] = rollout_id
        return self._request("POST", "/queue/complete", json=body)["ok"]

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

    def cancel(self, queue_ids: Sequence[str], *, reason: str = "") -> list[str]:
        """As every store's, by the server's store (it marks a leased try's rollout); more than
        ``wire.MAX_CANCEL_IDS`` ids go as several requests. A retry is answered the same."""
        ids = checks.check_cancel(queue_ids, reason)
        cancelled: list[str] = []
        for start in range(0, len(ids), wire.MAX_CANCEL_IDS):
            body = dict(queue_ids=ids[start:start + wire.MAX_CANCEL_IDS], reason=reason)
            cancelled += wire.Cancelled.model_validate(self._request("POST", "/queue/cancel", json=body)).cancelled
        return cancelled

    def queue_entries(self, group_ids: Sequence[str] | None = None) -> list[QueueEntry]:
        data = self._request("POST", "/queue/entries", json={"group_ids": list(group_ids) if group_ids is not None else None})
        return wire.QUEUE_ENTRIES.validate_python(data)

    def expire_rollout(self, entry: QueueEntry, reason: str) -> None:
        """A plain finish: the server's queue keeps the rollouts of tries it expired itself final."""
        self.finish_rollout(entry.rollout_id, RolloutStatus.TIMED_OUT, time.time(), reason)
