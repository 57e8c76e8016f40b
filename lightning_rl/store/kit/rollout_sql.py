"""The rollout queries of the SQL backends, built once and parameterised by the dialect.

SQLite and PostgreSQL answer ``rollouts()`` and the rollout page (``RolloutQuery``) with the same
statements over the same ``rollouts`` columns (the reward sum and count are columns the database keeps:
SQLite's migration 11, PostgreSQL's triggers, so no page aggregates). What differs is the dialect's:
its placeholder, its case-insensitive text match, how it puts NULLs last, and the column that keeps the
insertion order. A new SQL backend gives its :class:`Dialect` and runs the statements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...records import RolloutPage, RolloutQuery, RolloutRow
from ..rows import ROLLOUT_COLUMNS, rollouts_from_rows


@dataclass(frozen=True, slots=True)
class Dialect:
    """What a SQL database writes its own way."""

    mark: str  # a placeholder: ? or %s
    text_match: str  # ``(task LIKE ... OR rollout_id LIKE ...)``, with two placeholders, case as the database's
    nulls_last: bool  # the database has ``NULLS LAST`` (else: ``col IS NULL, col``)
    row_order: str  # the column in insertion order (the tie-break after start_time)


SQLITE = Dialect(mark="?", text_match="(task LIKE ? ESCAPE '\\' OR rollout_id LIKE ? ESCAPE '\\')", nulls_last=False,
                 row_order="rowid")
POSTGRES = Dialect(mark="%s", text_match="(task ILIKE %s OR rollout_id ILIKE %s)", nulls_last=True,
                   row_order="row_order")

_SELECT = f"SELECT {', '.join(ROLLOUT_COLUMNS)} FROM rollouts"
_NEVER_NULL = ("start_time", "status", "mode", "rollout_id")


@dataclass(frozen=True, slots=True)
class Statement:
    sql: str
    params: tuple


def rollouts_statement(dialect: Dialect, *, mode: str | None, status: str | None, since: float | None,
                       min_policy_version: int | None, limit: int | None, newest_first: bool) -> Statement:
    """``rollouts()``: filtered on the rollouts' own columns, in start order (or newest first)."""
    m = dialect.mark
    where, params = [], []
    for clause, value in ((f"mode = {m}", mode), (f"status = {m}", status), (f"start_time >= {m}", since),
                          (f"policy_version >= {m}", min_policy_version)):
        if value is not None:
            where.append(clause)
            params.append(value)
    sql = _SELECT + (" WHERE " + " AND ".join(where) if where else "")
    order = dialect.row_order
    sql += f" ORDER BY start_time DESC, {order} DESC" if newest_first else f" ORDER BY start_time, {order}"
    if limit is not None:
        sql += f" LIMIT {m}"
        params.append(int(limit))
    return Statement(sql, tuple(params))


def page_statements(dialect: Dialect, query: RolloutQuery) -> tuple[Statement, Statement]:
    """The rollout page: ``(count, rows)``, the second's rows for :func:`page_from_rows`."""
    m = dialect.mark
    where, params = [], []
    for column, value in (("mode", query.mode), ("status", query.status), ("agent", query.agent),
                          ("group_id", query.group_id), ("policy_version", query.policy_version)):
        if value is not None:
            where.append(f"{column} = {m}")
            params.append(value.value if hasattr(value, "value") else value)
    if query.text:
        pattern = "%" + query.text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        where.append(dialect.text_match)
        params += [pattern, pattern]
    if query.reward_min is not None:
        where.append(f"reward_sum >= {m}")
        params.append(query.reward_min)
    if query.reward_max is not None:
        where.append(f"reward_sum <= {m}")
        params.append(query.reward_max)
    clause = (" WHERE " + " AND ".join(where)) if where else ""
    direction = "DESC" if query.descending else "ASC"
    column = "reward_sum" if query.sort == "reward" else query.sort
    # columns that are never NULL sort without the NULLs-last term, so an index can give the order
    if query.sort in _NEVER_NULL:
        first = f"{column} {direction}"
    elif dialect.nulls_last:
        first = f"{column} {direction} NULLS LAST"
    else:
        first = f"{column} IS NULL, {column} {direction}"
    order = f"{first}, start_time {direction}, {dialect.row_order} {direction}"
    count = Statement(f"SELECT count(*) FROM rollouts{clause}", tuple(params))
    rows = Statement(f"{_SELECT.replace(' FROM rollouts', ', reward_sum, reward_count FROM rollouts')}{clause} "
                     f"ORDER BY {order} LIMIT {m} OFFSET {m}", (*params, query.limit, query.offset))
    return count, rows


def page_from_rows(found: Sequence[Sequence], total: int) -> RolloutPage:
    """The page from the rows of the second statement of :func:`page_statements` and the count."""
    n = len(ROLLOUT_COLUMNS)
    sums = {row[0]: (row[n] if row[n + 1] else None, row[n + 1]) for row in found}
    rows = [RolloutRow(rollout=rollout, reward=sums[rollout.rollout_id][0], rewards=sums[rollout.rollout_id][1])
            for rollout in rollouts_from_rows([row[:n] for row in found])]
    return RolloutPage(rows=rows, total=total)
