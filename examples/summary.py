"""The one-line JSON summary every example prints (what was captured, per agent)."""

from __future__ import annotations


def summarize(store, rollout_ids: list[str], train_agent: str = "solver") -> dict:
    """One JSON line: rollouts, mean reward, LLM calls per agent, engine-id coverage, per-agent samples."""
    from lightning_rl.store import trajectory, trajectory_samples

    trajectories = [trajectory(store, r) for r in rollout_ids]
    calls = [c for t in trajectories for c in t.llm_calls]
    per_agent: dict[str, int] = {}
    for c in calls:
        per_agent[c.agent_name or "-"] = per_agent.get(c.agent_name or "-", 0) + 1
    solver_only = sum(len(trajectory_samples(t, agents=[train_agent])[0]) for t in trajectories)
    everyone = sum(len(trajectory_samples(t)[0]) for t in trajectories)
    return {
        "rollouts": len(trajectories),
        "mean_reward": sum(t.final_reward or 0.0 for t in trajectories) / max(1, len(trajectories)),
        "llm_calls_per_agent": per_agent,
        "llm_calls_with_engine_token_ids": sum(c.token_ids_source == "engine" for c in calls),
        "llm_calls": len(calls),
        "tool_spans": sum(len(t.tool_spans) for t in trajectories),
        f"samples_{train_agent}_only": solver_only,
        "samples_all_agents": everyone,
        "store": store.url,
    }
