"""The write side a store over a database has in common: a background writer that never drops a record.

:class:`DurableWrites` holds the bounded background writer (``writer.py``), the prefix sharer of prompts
and messages (``tokens.py``) and the spill folder (``spill.py``), for a store that gives it two
functions of its database:

* ``apply(ops, sharer)``: write a batch in one transaction; returns the rollouts that finished (their
  shared prefixes are forgotten). What the database cannot take at all (locked, full, away) raises and is
  retried, then spilled, in order, as the wire's JSON ops (``wire.encode``), and replayed when it can be;
* ``keep_aside(note)``: store one ``Quarantine`` note in its own transaction; False when it was there
  already. An op that fails for a reason in its own data (``is_record_error``) is described and kept so,
  counted and reported once with the command that lists it; the rest of its batch is written.

Its spill files are adopted by the next process that opens the same folder if this one dies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ..diagnostics import count, report_failure
from . import wire
from .erasure import erase_from_spill_files
from .ops import EncodedSpan, Op, Quarantine, TracedSpan
from .quarantine import describe
from .spill import SpillFiles, claim_folder, release_folder
from .tokens import PrefixSharer
from .writer import BackgroundWriter


#: Seconds a traced span of a rollout still running may wait in memory for others to share its transaction
#: (``writer.py``'s commit window); a rollout's finish, a flush, a reward, an ingest are written at once.
COMMIT_WINDOW = 0.05


def _running_rollouts_span(op: Op) -> bool:
    return type(op) is TracedSpan


#: Ops an ingest (``add_spans``) hands the writer at once: one batch, one transaction, not a span at a time.
INGEST_CHUNK = 1000


class DurableWrites:
    def __init__(self, *, where: str, doctor: str, folder: Path,
                 apply: Callable[[list[Op], PrefixSharer], Iterable[str]], keep_aside: Callable[[Quarantine], bool],
                 is_record_error: Callable[[BaseException], bool], queue_size: int, give_up_after: float,
                 name: str, apply_here: Callable[[list[Op], PrefixSharer], Iterable[str]] | None = None) -> None:
        self.where, self.doctor = where, doctor
        self._apply_batch, self._keep_aside = apply, keep_aside
        self._apply_here = apply_here
        self.sharer = PrefixSharer()  # the writer thread's: prompts and messages stored as prefix + tail
        self.spills = SpillFiles(folder)
        self._erased: set[str] = set()  # erased rollouts the sharer has yet to forget
        self._erased_lock = threading.Lock()
        self.spills.adopt_orphans(own=claim_folder(folder))
        self.writer = BackgroundWriter(
            self._apply, maxsize=queue_size, name=name, spill=self._spill, replay=self._replay,
            backlog=lambda: bool(self.spills.files), give_up_after=give_up_after, quarantine=self._quarantine,
            is_record_error=is_record_error, window=COMMIT_WINDOW, may_wait=_running_rollouts_span,
            write_here=None if apply_here is None else self._write_here)
        if self.spills.files:
            self.writer.flush(0)  # wakes the writer, which writes the backlog back first

    def erase(self, rollout_ids: list[str], delete: Callable[[], int]) -> int:
        """Erase rollouts (``erasure.py``): what is queued is written (or spilled) first; then, while no
        replay runs, their lines leave the spill files and ``delete()`` removes their rows (its result is
        returned); the prefix sharer forgets them (on the writer thread, before its next batch)."""
        self.writer.flush()
        with self.spills.lock:
            erase_from_spill_files(self.spills, rollout_ids)
            removed = delete()
        with self._erased_lock:
            self._erased.update(rollout_ids)
        return removed

    def close(self) -> None:
        """Write what is queued, try the backlog once more (what stays is adopted by the next open)."""
        self.writer.close()
        if self.spills.files:
            try:
                self._replay()
            except Exception as exc:
                report_failure("spill replay", exc)
        release_folder(self.spills.folder)

    # -- the writer thread (and a putting thread's write of a due window, ``writer.py`` "Writing here") --------
    def _apply(self, ops: list[Op], apply: Callable[[list[Op], PrefixSharer], Iterable[str]] | None = None) -> None:
        if self._erased:
            with self._erased_lock:
                erased, self._erased = self._erased, set()
            for rollout_id in erased:
                self.sharer.forget(rollout_id)
        for rollout_id in (apply or self._apply_batch)(ops, self.sharer):
            self.sharer.forget(rollout_id)

    def _write_here(self, ops: list[Op]) -> None:
        """A running rollouts' spans, written on the thread that put the last of them: never waits for the database
        (``apply_here``); raises where it would, and the writer writes them."""
        self._apply(ops, self._apply_here)

    def _spill(self, ops: list[Op]) -> None:
        lines = []
        for op in ops:
            try:
                lines.append(wire.encode(op))
            except Exception as exc:  # JSON cannot hold it: it waits, described, for the quarantine table
                lines.append(wire.encode(describe(op, exc)))
        self.spills.append(lines)
        report_failure("spill", message=f"lightning-rl: store {self.where} unwritable; records spilled to "
                                        f"{self.spills.folder} (written back, in order, when it can be)")

    def _replay(self) -> bool:
        """Write the spill files back, oldest first. True when none is left. A line that is not an op this
        version can read is quarantined, and so is an op the database refuses; everything else is written.
        Raises only while the database cannot be written."""
        while self.spills.files:
            with self.spills.lock:  # an erasure does not rewrite a file while it is replayed
                path = self.spills.files[0]
                ops: list[Op] = []
                for number, line in enumerate(SpillFiles.read(path), 1):
                    try:
                        ops.append(wire.decode(line))
                    except Exception as exc:  # not JSON, an unknown op, a payload of another shape
                        text = line.decode(errors="replace")
                        ops.append(Quarantine("spill line", None,
                                              f"line {number} of spill file {path.name}: {exc}"[:2000], text[:100_000]))
                self.writer.write(ops)
                path.unlink()
                self.spills.files.pop(0)
            count("spill_files_replayed")
        return True

    def _quarantine(self, op: Op, exc: BaseException) -> None:
        """Keep aside one op the database refused for its own data (the writer's isolation)."""
        note = op if type(op) is Quarantine else describe(op, exc)
        if type(op) is TracedSpan:
            self.sharer.drop(op.row.rollout_id, op.row.seq)
        elif type(op) is EncodedSpan and len(op.values) > 1:
            self.sharer.drop(op.values[0], op.values[1])
        if self._keep_aside(note):
            count("records_quarantined")
            report_failure("record quarantined", message=(
                f"lightning-rl: a {note.what} record could not be written to {self.where} ({note.reason[:300]}); it "
                "is kept in the store's quarantine with its original form and the rest of its batch was written. "
                f"`{self.doctor}` lists what is there (logged once)"))
