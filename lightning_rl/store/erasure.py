"""Erasing rollouts (``delete_rollouts``, ``lightning-rl store prune``): the rows, and the bytes in the files.

A rollout is erased with everything that belongs to it: its row, its spans (with their prefix-shared
prompt tokens and message text: a span only ever refers to an earlier span of its own rollout, so no
other rollout's rows need them), its rewards, its task-queue entry, its quarantined records, and the
lines for it that wait in the store's local spill files (rewritten without them). Other rollouts keep
everything, their reward sums included (each rollout's sums are over its own rewards). Policy records
(``record_policy``, the ``trained_on`` lineage of group ids) are kept: they name groups, not content.

How the text leaves the files is each backend's (``docs/retention.md``): SQLite's in ``sqlite/erasure.py``,
PostgreSQL's in ``postgres/erasure.py``; both delete the rows of ``OWNED_TABLES``, ``ERASE_CHUNK`` ids a statement.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from ..diagnostics import count
from ..errors import ConfigurationError
from . import wire
from .ops import rollout_of
from .spill import SpillFiles, rejected_files_in, spill_files_in

#: Tables with a ``rollout_id`` column whose rows belong to a rollout; ``rollouts`` itself goes last.
OWNED_TABLES = ("spans", "rewards", "queue", "quarantine")
ERASE_CHUNK = 500  # ids per statement: far below SQLite's bound-parameter limit


def rollout_id_list(rollout_ids: Iterable[str]) -> list[str]:
    """The ids to erase, each once, in order; a value that is not a string is a mistake said at once."""
    if isinstance(rollout_ids, (str, bytes)):
        raise ConfigurationError(f"delete_rollouts takes a list of rollout ids, got the string {rollout_ids!r:.80}; "
                                 "write delete_rollouts([rollout_id])")
    ids = list(dict.fromkeys(rollout_ids))
    bad = [r for r in ids if not isinstance(r, str)]
    if bad:
        raise ConfigurationError(f"rollout ids are strings; got {bad[0]!r:.80} ({type(bad[0]).__name__})")
    return ids


def erased(rollouts: int) -> int:
    """Count what an erasure removed (``lrl.stats()`` shows ``rollouts_deleted``)."""
    count("rollouts_deleted", rollouts)
    return rollouts


# -- spill files ---------------------------------------------------------------------------------------
def _line_rollout(line: bytes, quoted: dict[bytes, str]) -> str | None:
    try:
        return rollout_of(wire.decode(line))
    except Exception:  # a rejected record, a description, a line of another version: find the id in its text
        for needle, rollout_id in quoted.items():
            if needle in line:
                return rollout_id
        return None


def erase_from_spill_files(spills: SpillFiles, rollout_ids: Iterable[str]) -> int:
    """Rewrite every spill and ``rejected-*`` file in the folder of ``spills`` without the lines of
    ``rollout_ids`` (a new file, fsynced, put in place of the old one). Returns the lines removed. Hold
    ``spills.lock``: a replay of this process waits meanwhile."""
    ids = set(rollout_ids)
    if not ids or not spills.folder.is_dir():
        return 0
    quoted = {orjson.dumps(r): r for r in ids}
    removed = 0
    for path in [*spill_files_in(spills.folder), *rejected_files_in(spills.folder)]:
        try:
            lines = SpillFiles.read(path)
        except FileNotFoundError:  # replayed meanwhile by another process
            continue
        head = lines[:1] if path.name.startswith("rejected-") else []  # the reason stays
        kept = head + [line for line in lines[len(head):] if _line_rollout(line, quoted) not in ids]
        if len(kept) == len(lines):
            continue
        removed += len(lines) - len(kept)
        tmp = path.with_name(path.name + ".erase")
        with open(tmp, "wb") as out:
            out.write(b"".join(line + b"\n" for line in kept))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    if removed:
        count("spill_lines_erased", removed)
    return removed


# -- prune (``lightning-rl store prune``) ---------------------------------------------------------------
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*")


def parse_duration(text: str, option: str = "--older-than") -> float:
    """``"30d"`` as seconds: a number and one unit of s, m, h, d, w."""
    found = _DURATION.fullmatch(str(text))
    if not found:
        raise ConfigurationError(f"{option} {text!r:.40} is not a duration: give a number and a unit of s, m, h, d "
                                 f"or w (seconds, minutes, hours, days, weeks), e.g. {option} 30d")
    seconds = float(found.group(1)) * _UNITS[found.group(2)]
    if not seconds < 100 * 366 * 86400:  # a cut-off before 1926 (or past what a float holds) is a typo
        raise ConfigurationError(f"{option} {text!r:.40} is more than 100 years: give a number and a unit of s, m, "
                                 f"h, d or w, e.g. {option} 30d")
    return seconds


@dataclass(slots=True)
class PruneResult:
    """What ``prune`` removed (or, with ``dry_run``, would remove)."""

    cutoff: float
    rollout_ids: list[str]
    spans: int
    rewards: int
    kept_trained: int  # old enough, kept because a published policy was trained on their group
    deleted: int  # rollouts removed (0 for a dry run)


def prune(store: Any, older_than: float, *, mode: str | None = None, keep_trained: bool = False,
          dry_run: bool = False, full: bool = False, now: float | None = None) -> PruneResult:
    """Erase the rollouts of ``store`` that ended ``older_than`` seconds ago or earlier (a rollout that never
    ended: that started so), of ``mode`` only if given; ``keep_trained`` keeps those whose group id is in a
    policy record's ``trained_on`` lineage. Their spans and rewards are counted (read) first."""
    cutoff = (time.time() if now is None else now) - older_than
    old = [r for r in store.rollouts(mode=mode) if (r.end_time if r.end_time is not None else r.start_time) < cutoff]
    kept = 0
    if keep_trained:
        lineage = {g for p in store.policies() for g in (p.trained_on or ())}
        chosen = [r for r in old if r.group_id not in lineage]
        kept, old = len(old) - len(chosen), chosen
    ids = [r.rollout_id for r in old]
    spans = rewards = 0
    for _, found_spans, found_rewards in store.rollout_data(ids):
        spans, rewards = spans + len(found_spans), rewards + len(found_rewards)
    deleted = 0 if dry_run or not ids else store.delete_rollouts(ids, full=full)
    return PruneResult(cutoff, ids, spans, rewards, kept, deleted)
