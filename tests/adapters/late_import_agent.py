"""A fresh process whose traced function imports AutoGen inside its first call.

Run: python late_import_agent.py BASE_URL DB   (from this directory). Prints the agent names of the
first rollout's LLM calls as JSON.
"""

import asyncio
import json
import sys

import lightning_rl as lrl

assert "autogen_agentchat" not in sys.modules, "this check needs a process that has not imported AutoGen yet"
store = lrl.configure(store=f"sqlite:///{sys.argv[2]}")


@lrl.trace
async def first_rollout(question):
    import autogen_agents  # AutoGen's first import in this process happens here, inside the rollout

    await autogen_agents.round_robin(sys.argv[1]).run(task=question)
    return 1.0


asyncio.run(first_rollout("What is 12+30?"))
(trajectory,) = lrl.trajectories(store)
print(json.dumps(sorted({c.agent_name for c in trajectory.llm_calls})))
