"""A process that traces rollouts into a SQLite file forever, printing each finished rollout's id
(the reliability suite kills it with SIGKILL)."""

import sys

import lightning_rl as lrl

lrl.configure(store=sys.argv[1])
finished: list[str] = []


@lrl.trace
def agent(task: dict) -> float:
    finished.append(lrl.current_rollout_id())
    for i in range(20):
        with lrl.tool_span("step", arguments={"i": i, "pad": "x" * 300}):
            pass
    lrl.emit_reward(0.5, name="mid")
    return 1.0


while True:
    agent({"n": 1})
    print(finished[-1], flush=True)  # printed only after the traced call returned: durable by then
