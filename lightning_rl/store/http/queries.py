"""What an ``HttpStore`` reads from its server, and its policy log: the rollout reader and index, the
quarantine, publishes and decisions, each a plain request (``ServerQueries``, a base class of ``HttpStore``,
``client.py``, whose ``_request`` fails over and retries)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from ...errors import RolloutNotFoundError
from ...records import (
    PolicyDecision, PolicyRecord, QuarantinedRecord, Reward, Rollout, RolloutPage, RolloutQuery, RolloutStatus, Span,
)
from .. import checks, scan, wire


class ServerQueries:
    """The read side and the policy log of ``HttpStore`` (``client.py``), over its ``_request``."""

    url: str
    _request: Callable[..., Any]

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


def _quote(rollout_id: str) -> str:
    return quote(rollout_id, safe="")
