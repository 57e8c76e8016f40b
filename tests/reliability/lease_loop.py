"""A process that leases from a store's queue (argv[1]: a server URL list or a postgresql:// URL) and never
completes, printing each lease as ``[queue_id, tries, rollout_id]``, until every entry of group argv[2]
is done (each expired max_tries times) or 90 s passed. The fleet queue test runs several at once."""

import json
import sys
import time

from lightning_rl.store.uri import open_store

store = open_store(sys.argv[1])
group, name = sys.argv[2], sys.argv[3]
deadline = time.monotonic() + 90
while time.monotonic() < deadline:
    got = store.lease(name, lease_seconds=0.3, limit=2)
    for entry in got:
        print(json.dumps([entry.queue_id, entry.tries, entry.rollout_id]), flush=True)
    if not got:
        if all(e.status.value == "done" for e in store.queue_entries([group])):
            break
        time.sleep(0.02)
store.close()
