"""Closing a SQLite store while other threads read it (the tracer's policy-version refresh does, every
second): the readers get ``StoreClosedError``, never a crash. Before the fix ``close()`` closed the read
connection under a query running in another thread and the process died of SIGSEGV (seen in
``make test-fast``, 2026-11-27, in the refresh thread of ``tests/tracer/test_policy_versions.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, sys, tempfile, threading, time
    from lightning_rl.errors import StoreClosedError
    from lightning_rl.store import SQLiteStore

    folder = tempfile.mkdtemp()
    seen = set()
    for i in range(int(sys.argv[1])):
        store = SQLiteStore(os.path.join(folder, f"s{i}.db"))
        for v in range(50):
            store.record_policy("policy", v, served_as=f"policy@v{v}")
        store.enqueue({"q": i}, n=2)
        stopped = threading.Event()

        def read():
            while not stopped.is_set():
                try:
                    store.latest_policies()
                    store.policies()
                    store.queue_entries()  # the queue's own connection
                except Exception as exc:
                    seen.add(type(exc).__name__)
                    return

        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        time.sleep(0.01)
        store.close()
        stopped.set()
        for t in readers:
            t.join()
    print(sorted(seen))
""")


def test_closing_a_store_under_its_readers_raises_in_them_and_never_crashes(tmp_path):
    script = tmp_path / "close_race.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), "30"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rc {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.strip() in ("[]", "['StoreClosedError']"), proc.stdout


def test_a_closed_store_says_so_on_a_read(tmp_path):
    import pytest

    from lightning_rl.errors import StoreClosedError
    from lightning_rl.store import SQLiteStore

    store = SQLiteStore(tmp_path / "closed.db")
    store.record_policy("policy", 1)
    store.close()
    with pytest.raises(StoreClosedError, match=r"closed\.db.* is closed; open it again"):
        store.policies()
    with pytest.raises(StoreClosedError, match="is closed"):
        store.queue_entries()
    store.close()  # twice is fine
    reopened = SQLiteStore(tmp_path / "closed.db", read_only=True)
    assert [p.version for p in reopened.policies()] == [1]  # nothing recorded was lost
    reopened.close()
    with pytest.raises(StoreClosedError):
        reopened.policies()
