"""What callers pass to a store, checked once for every store: each message names the value and the fix.

Every store calls these at the top of its public methods (the store server calls the same methods,
so a value refused locally is refused over HTTP with the same words).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from ..boundaries import check_int, json_problem
from ..errors import (
    ConfigurationError,
    RolloutNotFoundError,
    StoreError,
    check_reward,
    shown,
)
from ..records import QUEUE_OVERRIDE_KEYS, SAMPLING_KEYS, Decision, PolicyDecision, PolicyRecord, Reward, RewardSource, RolloutQuery, RolloutStatus
from ..settings import check_mode


def check_count(value: Any, name: str, *, minimum: int = 0, optional: bool = False) -> None:
    """A count, position or version a caller passes: an int from ``minimum`` to 2**63-1 (SQLite's range)."""
    check_int(value, name, minimum=minimum, optional=optional)


def check_position(after: Any) -> None:
    check_int(after, "after", meaning="a position returned by rewarded_since")


def since_time(value: float | dt.datetime | None) -> float | None:
    """``since`` as a UNIX time (a datetime is converted)."""
    if value is None or isinstance(value, (int, float)):
        return value
    if isinstance(value, dt.datetime):
        return value.timestamp()
    raise ConfigurationError(f"since must be a UNIX time or a datetime, got {shown(value)}")


def rollout_filters(mode: str | None, status: str | RolloutStatus | None, since: float | dt.datetime | None,
                    min_policy_version: int | None, limit: int | None) -> tuple[str | None, str | None, float | None]:
    """The filters of ``rollouts()`` checked: ``(mode, status value, since as a UNIX time)``."""
    if mode is not None:
        check_mode(mode)
    check_count(min_policy_version, "min_policy_version", optional=True)
    check_count(limit, "limit", optional=True)
    if status is not None:
        try:
            status = RolloutStatus(status).value
        except ValueError:
            raise ConfigurationError(
                f"status {status!r} is not one of {', '.join(s.value for s in RolloutStatus)}") from None
    return mode, status, since_time(since)


def rollout_query(query: RolloutQuery | None, filters: dict[str, Any]) -> RolloutQuery:
    """``rollout_page``'s query: the one given, or one built from keyword filters."""
    if query is not None:
        return query
    try:
        return RolloutQuery(**filters)
    except ValidationError as exc:
        raise ConfigurationError(f"bad rollout query: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


def new_reward(rollout_id: str, value: Any, name: str, *, llm_call_index: int | None, agent: str | None,
               source: str | RewardSource, uid: str | None) -> Reward:
    """The record ``add_reward`` stores (the rollout's existence is the store's to check)."""
    value = check_reward(value, what=f"reward {name!r}")
    check_count(llm_call_index, "llm_call_index", optional=True)
    return Reward(rollout_id=rollout_id, value=value, name=name, llm_call_index=llm_call_index, agent=agent,
                  source=RewardSource(source), **({"uid": uid} if uid else {}))


def policy_record(served_name: Any, version: Any, *, adapter: str | None, time: float | None,
                  trained_on: Sequence[str] | None, served_as: str | None = None) -> PolicyRecord:
    """The record ``record_policy`` stores."""
    if not isinstance(served_name, str) or not served_name:
        raise ConfigurationError(f"served_name must be the model name agents request, got {shown(served_name)}")
    check_count(version, "policy version")
    if trained_on is not None:
        if not isinstance(trained_on, (list, tuple)):
            raise ConfigurationError(f"trained_on must be a list of rollout group ids (or None), got {shown(trained_on)}")
        bad = [g for g in trained_on if not isinstance(g, str) or not g]
        if bad:
            raise ConfigurationError(
                f"trained_on must hold non-empty group id strings, got {shown(bad[0])} in {shown(trained_on)}")
        trained_on = list(trained_on)
    if served_as is not None and (not isinstance(served_as, str) or not served_as or served_as == served_name):
        raise ConfigurationError(f"served_as must be the version's own served name (e.g. {served_name}@v{version}), "
                                 f"other than {served_name!r}, or None; got {shown(served_as)}")
    return PolicyRecord(served_name=served_name, version=version, adapter=adapter, trained_on=trained_on,
                        served_as=served_as, **({"time": time} if time is not None else {}))


def decision_record(served_name: Any, version: Any, decision: Any, *, live_version: Any = None,
                    adapter: str | None = None, figures: Mapping[str, Any] | None = None, reason: str | None = None,
                    time: float | None = None) -> PolicyDecision:
    """The record ``record_decision`` stores."""
    if not isinstance(served_name, str) or not served_name:
        raise ConfigurationError(f"served_name must be the model name agents request, got {shown(served_name)}")
    check_count(version, "policy version")
    check_count(live_version, "live policy version", optional=True)
    if decision not in {d.value for d in Decision}:
        raise ConfigurationError(f"decision must be one of {[d.value for d in Decision]}, got {shown(decision)}")
    figures = dict(figures or {})
    bad = [k for k, v in figures.items() if not isinstance(k, str)
           or not (v is None or isinstance(v, (int, float, str))) or (isinstance(v, float) and not math.isfinite(v))]
    if bad:
        raise ConfigurationError(f"figures must map names to finite numbers, text or None; {shown(bad[0])} holds "
                                 f"{shown(figures[bad[0]])}")
    return PolicyDecision(served_name=served_name, version=version, decision=Decision(decision),
                          live_version=live_version, adapter=adapter, figures=figures, reason=reason,
                          **({"time": time} if time is not None else {}))


def check_task(task: Any, *, mode: str, max_tries: Any) -> None:
    """What ``enqueue`` takes: a task JSON can hold, a known mode, at least one try."""
    check_mode(mode)
    problem = json_problem(task, "task")
    if problem:
        raise ConfigurationError(f"the task cannot be stored: {problem}")
    check_count(max_tries, "max_tries", minimum=1)


def check_overrides(overrides: Any) -> dict[str, Any] | None:
    """What a queued try may carry for its runner (``QueueEntry.overrides``): ``endpoint`` ``[base_url, model]``
    and ``sampling`` (numbers under ``SAMPLING_KEYS``). Returns it as stored (the endpoint a list)."""
    if overrides is None:
        return None
    if not isinstance(overrides, Mapping) or set(overrides) - QUEUE_OVERRIDE_KEYS:
        raise ConfigurationError(f"overrides must be a dict with keys among {sorted(QUEUE_OVERRIDE_KEYS)}, got "
                                 f"{shown(overrides)}")
    out: dict[str, Any] = {}
    endpoint = overrides.get("endpoint")
    if endpoint is not None:
        if (isinstance(endpoint, (str, bytes)) or not isinstance(endpoint, Sequence) or len(endpoint) != 2
                or not all(isinstance(x, str) and x for x in endpoint)):
            raise ConfigurationError(f"overrides['endpoint'] must be [base_url, model], two non-empty strings, got "
                                     f"{shown(endpoint)}")
        out["endpoint"] = list(endpoint)
    sampling = overrides.get("sampling")
    if sampling is not None:
        if (not isinstance(sampling, Mapping) or set(sampling) - SAMPLING_KEYS or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in sampling.values())):
            raise ConfigurationError(f"overrides['sampling'] must map keys among {sorted(SAMPLING_KEYS)} to finite "
                                     f"numbers, got {shown(sampling)}")
        out["sampling"] = dict(sampling)
    return out or None


#: the longest reason ``cancel`` keeps (it becomes the error text of a cancelled try's rollout)
MAX_CANCEL_REASON = 4096


def check_cancel(queue_ids: Any, reason: Any) -> list[str]:
    """What ``cancel`` takes: a list (or tuple) of queue ids, and a reason that is a string. Returns the ids."""
    if (isinstance(queue_ids, (str, bytes)) or not isinstance(queue_ids, Sequence)
            or not all(isinstance(q, str) and q for q in queue_ids)):
        raise ConfigurationError(f"cancel takes a list of queue ids (QueueEntry.queue_id, non-empty strings), got "
                                 f"{shown(queue_ids)}; give e.g. cancel([entry.queue_id])")
    if not isinstance(reason, str) or len(reason) > MAX_CANCEL_REASON:
        raise ConfigurationError(f"cancel's reason must be a string of at most {MAX_CANCEL_REASON} characters, got "
                                 f"{shown(reason)}; give e.g. reason='the trainer stopped waiting'")
    return list(queue_ids)


def check_idle_seconds(idle_seconds: Any) -> None:
    if not (isinstance(idle_seconds, (int, float)) and idle_seconds > 0):
        raise ConfigurationError(f"idle_seconds must be a number of seconds > 0, got {idle_seconds!r}")


def not_found(rollout_id: str, url: str) -> RolloutNotFoundError:
    return RolloutNotFoundError(f"no rollout {shown(rollout_id)} in {url}; list ids with `lightning-rl rollouts ls`")


def read_only(what: str, where: str) -> StoreError:
    """The error of a write to a store opened read-only (``what`` names the call)."""
    return StoreError(f"{what}: the store {where} was opened read-only (the viewer's mode); open it with "
                      "open_store(url) to write")
