"""``RolloutIndex`` questions and the rollout page answered by reading the records: the way a store
without SQL (the in-memory one; the HTTP client, where the server has no route for it) implements them.
The SQLite store answers the same questions in SQL (``sqlite/reads.py``); ``tests/store`` checks that both
give the same answers."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import orjson

from .. import semconv
from ..records import Reward, Rollout, RolloutPage, RolloutQuery, RolloutRow, Span
from .protocols import Store


def page_matches(query: RolloutQuery, row: RolloutRow) -> bool:
    r = row.rollout
    if any(want is not None and have != want for want, have in (
            (query.mode, r.mode), (query.status, r.status), (query.agent, r.agent), (query.group_id, r.group_id),
            (query.policy_version, r.policy_version))):
        return False
    if (query.reward_min is not None or query.reward_max is not None) and row.reward is None:
        return False
    if query.reward_min is not None and row.reward < query.reward_min:
        return False
    if query.reward_max is not None and row.reward > query.reward_max:
        return False
    if query.text:
        task = orjson.dumps(r.task).decode() if r.task is not None else ""
        text = query.text.lower()  # as SQLite's LIKE: ASCII letters in any case
        if text not in task.lower() and text not in r.rollout_id.lower():
            return False
    return True


def page_sort_key(query: RolloutQuery, row: RolloutRow) -> tuple:
    value = row.reward if query.sort == "reward" else getattr(row.rollout, query.sort)
    return (value is None, "" if value is None else value, row.rollout.start_time)


def rollout_page(data: Iterable[tuple[Rollout, list[Reward]]], query: RolloutQuery) -> RolloutPage:
    """The page of ``query`` from every rollout with its rewards, filtered and sorted in Python."""
    rows = []
    for rollout, rewards in data:
        values = [r.value for r in rewards if r.name == "reward"]
        row = RolloutRow(rollout=rollout, reward=sum(values) if values else None, rewards=len(values))
        if page_matches(query, row):
            rows.append(row)
    rows.sort(key=lambda row: page_sort_key(query, row), reverse=query.descending)
    rows.sort(key=lambda row: page_sort_key(query, row)[0])  # no value (no reward, no agent) last, either way
    return RolloutPage(rows=rows[query.offset:query.offset + query.limit], total=len(rows))


def ids_with_prefix(rollout_ids: Iterable[str], prefix: str, limit: int) -> list[str]:
    """Up to ``limit`` of ``rollout_ids`` starting with ``prefix``, in order."""
    return sorted(rid for rid in rollout_ids if rid.startswith(prefix))[:limit]


def llm_calls_in(spans: Iterable[Span]) -> int:
    return sum(1 for s in spans if isinstance(op := s.attributes.get(semconv.GEN_AI_OPERATION_NAME), str)
               and op in semconv.LLM_OPERATIONS)


def llm_call_counts(store: Store, rollout_ids: Sequence[str]) -> dict[str, int]:
    """LLM calls per rollout, for the ids that exist (their spans read through ``store.rollout_data``)."""
    existing = store.existing_rollout_ids(rollout_ids)
    found = [rid for rid in dict.fromkeys(rollout_ids) if rid in existing]
    return {rollout.rollout_id: llm_calls_in(spans) for rollout, spans, _ in store.rollout_data(found)}


def last_activity(spans: Iterable[Span], rewards: Iterable[Reward]) -> float | None:
    """When the last span ended or the last reward came (UNIX time); None when neither happened."""
    times = [*(s.end_ns / 1e9 for s in spans), *(r.time for r in rewards)]
    return max(times) if times else None

