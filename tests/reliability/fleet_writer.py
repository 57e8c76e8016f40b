"""A process that traces rollouts through an HttpStore given several store servers (argv[1], commas),
printing ``acked <rollout id>`` once the flush after its traced call returned True (acknowledged: on a
server, or in this process's spill file), until the file argv[2] exists; then it closes the store (its
backlog is replayed) and prints ``counters <json>`` (its counters, and under ``server`` the store server it
used last). The fleet reliability tests kill a server and restart the database under it."""

import json
import os
import sys

import lightning_rl as lrl
from lightning_rl.store.http.client import HttpStore

SPANS = 20  # tool spans per rollout; with the rollout's own span, 21 rows; two rewards ("mid", "reward")
urls, stop_file, name = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
store = HttpStore(urls, retry_for=300)
lrl.configure(store=store)
ids: list[str] = []


@lrl.trace
def agent(task: dict) -> float:
    ids.append(lrl.current_rollout_id())
    for i in range(SPANS):
        with lrl.tool_span("step", arguments={"i": i, "pad": "x" * 200}):
            pass
    lrl.emit_reward(0.5, name="mid")
    return 1.0


i = 0
while not os.path.exists(stop_file):
    agent({"writer": name, "i": i})
    i += 1
    if store.flush(60):
        print(f"acked {ids[-1]}", flush=True)
store.close()
print(f"counters {json.dumps({**lrl.stats(), 'server': store.servers[0]})}", flush=True)
