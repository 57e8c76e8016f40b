"""``lightning-rl rollouts``: list, inspect and expire rollouts."""

from __future__ import annotations

import json
from typing import Any

import click

from ._common import STORE_HELP, errors, open_store, when

@click.group()
def rollouts() -> None:
    """List and inspect rollouts."""


@rollouts.command("ls")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--mode", type=click.Choice(["train", "eval", "prod"]), default=None)
@click.option("--status", default=None, help="queued, running, succeeded, failed or timed_out.")
@click.option("--limit", type=int, default=20, show_default=True, help="Newest N rollouts (0 = all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@errors
def rollouts_ls(store: str | None, mode: str | None, status: str | None, limit: int, as_json: bool) -> None:
    """List rollouts, newest first.

    Example: lightning-rl rollouts ls --store runs.db --status failed --json
    """
    with open_store(store) as s:
        rows = s.rollouts(mode=mode, status=status, limit=limit or None, newest_first=True)
        calls = s.llm_call_counts([r.rollout_id for r in rows])
        if as_json:
            for r in rows:
                click.echo(json.dumps({**r.model_dump(mode="json"), "llm_calls": calls.get(r.rollout_id, 0)}))
            return
        click.echo(f"{'ROLLOUT':32}  {'STATUS':9}  {'MODE':5}  {'AGENT':16}  {'POLICY':6}  {'CALLS':>5}  STARTED")
        empty = 0
        for r in rows:
            n = calls.get(r.rollout_id, 0)
            marked = r.status.finished and n == 0
            empty += marked
            click.echo(
                f"{r.rollout_id:32}  {r.status.value:9}  {r.mode.value:5}  {(r.agent or '-')[:16]:16}  "
                f"{r.policy_version if r.policy_version is not None else '-':>6}  {str(n) + ('!' if marked else ''):>5}  "
                f"{when(r.start_time)}"
            )
        if empty:
            click.echo(f"{empty} finished rollout(s) marked ! recorded no LLM call: they train nothing. If the agent "
                       "called a model, the call bypassed capture (lrl.stats(): llm_calls_bypassing_capture); send it "
                       "through the gateway or the openai client", err=True)


def _clip(value: object, limit: int = 200) -> str:
    """A tool's arguments, result or error on one line of ``rollouts show``."""
    text = " ".join(str("" if value is None else value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _message_line(message: dict[str, Any]) -> list[str]:
    role = message.get("role", "?")
    content = message.get("content")
    if isinstance(content, list):
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    lines = [f"    {role}: {content}" if content else f"    {role}:"]
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") or {}
        lines.append(f"      -> tool call {fn.get('name')}({fn.get('arguments')}) id={tc.get('id')}")
    return lines


@rollouts.command("expire")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--idle", type=float, required=True, help="Seconds since the rollout's start, last span or reward.")
@click.option("--origin", default=None, help="Only rollouts of this origin (gateway: opened over a gateway's API).")
@errors
def rollouts_expire(store: str | None, idle: float, origin: str | None) -> None:
    """End as timed_out the running rollouts nothing reached for --idle seconds (their process was killed).

    A gateway does this for its own on start; this is for the rest (a traced agent's process killed outright).
    What they recorded stays. Make sure no live process still runs them: one that does gets its finish refused.

    Example: lightning-rl rollouts expire --idle 3600 --store runs.db
    """
    from ..store import expire_idle_running

    with open_store(store) as s:
        ended = expire_idle_running(s, idle, origin=origin)
    for rollout_id in ended:
        click.echo(rollout_id)
    click.echo(f"{len(ended)} running rollout(s) idle for {idle:g} s or more ended as timed_out", err=True)


@rollouts.command("show")
@click.argument("rollout_id")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--credit", default="final", show_default=True, help="Credit assignment for per-call rewards.")
@click.option("--json", "as_json", is_flag=True, help="The assembled trajectory as JSON.")
@errors
def rollouts_show(rollout_id: str, store: str | None, credit: str, as_json: bool) -> None:
    """Show one rollout (its id, or the first characters of it that only it starts with): the conversation
    with tool calls, token counts and rewards.

    Example: lightning-rl rollouts show 3f2a9c1b07de --store runs.db
    """
    from ..store import resolve_rollout_id, trajectory

    with open_store(store) as s:
        t = trajectory(s, resolve_rollout_id(s, rollout_id), credit=credit)
    if as_json:
        click.echo(t.model_dump_json(indent=2))
        return
    click.echo(f"rollout {t.rollout_id}  {t.status.value}  mode={t.mode.value}  policy={t.policy_version}  "
               f"final_reward={t.final_reward}")
    click.echo(f"  task: {json.dumps(t.task)[:300]}")
    if t.error:
        click.echo(f"  error: {t.error}")
    seen: list[dict[str, Any]] = []
    for c in t.llm_calls:
        ids = f"{len(c.prompt_token_ids)}+{len(c.response_token_ids)} tokens ({c.token_ids_source.value})"
        click.echo(f"  [{c.index}] {c.agent_name or '-'}  {c.operation} {c.model}  {ids}  reward={c.reward}"
                   + ("  streamed" if c.streamed else "") + ("  INCOMPLETE" if c.incomplete else ""))
        new = c.input_messages[len(seen):] if c.input_messages[: len(seen)] == seen else c.input_messages
        for m in new:
            for line in _message_line(m):
                click.echo(line)
        for m in c.output_messages:
            for line in _message_line(m):
                click.echo(line)
        seen = c.input_messages + c.output_messages
    for span in t.tool_spans:
        a = span.attributes
        agent = a.get("gen_ai.agent.name")
        click.echo(f"  tool {a.get('gen_ai.tool.name')}({_clip(a.get('gen_ai.tool.call.arguments'))})"
                   + (f" by {agent}" if agent else "") + f" id={a.get('gen_ai.tool.call.id')}"
                   + (f"  ERROR {_clip(span.status_message)}" if span.status_code == "ERROR"
                      else f" -> {_clip(a.get('gen_ai.tool.call.result'))}"))
    if t.missing_token_ids:
        click.echo(f"  warning: {t.missing_token_ids} LLM call(s) have no engine token ids and cannot be trained on")
    for r in t.rewards:
        where = f"call {r.llm_call_index}" if r.llm_call_index is not None else "rollout"
        click.echo(f"  reward {r.name}={r.value} ({r.source.value}, {where}{', agent ' + r.agent if r.agent else ''})")
