"""The ``lightning-rl`` command: a thin layer over the Python API (one public call per command)."""

from __future__ import annotations

import datetime as dt
import functools
import json
import sys
from typing import Any

import click

from .errors import LightningRLError, missing_dependency
from .settings import ENV_GATEWAY_TOKEN, ENV_STORE_TOKEN, ENV_VIEW_TOKEN

STORE_HELP = "Store URL or path (default: $LIGHTNING_RL_STORE or ./lightning_rl.db)."


def _errors(fn):
    """User mistakes exit 1 with one line, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LightningRLError as exc:
            raise click.ClickException(str(exc)) from None
        except ImportError as exc:  # an optional dependency: one line naming the extra, no traceback
            missing = missing_dependency(exc)
            if missing is None:
                raise
            raise click.ClickException(str(missing)) from None

    return wrapper


def _open(store: str | None, *, read_only: bool = False):
    from ._api import open_store

    return open_store(store, read_only=read_only)


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


@click.group()
@click.version_option(package_name="lightning-rl")
def main() -> None:
    """Trace agents, store their rollouts, export training samples.

    Example: lightning-rl rollouts ls --store sqlite:///runs.db
    """


@main.group()
def rollouts() -> None:
    """List and inspect rollouts."""


@rollouts.command("ls")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--mode", type=click.Choice(["train", "eval", "prod"]), default=None)
@click.option("--status", default=None, help="queued, running, succeeded, failed or timed_out.")
@click.option("--limit", type=int, default=20, show_default=True, help="Newest N rollouts (0 = all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@_errors
def rollouts_ls(store: str | None, mode: str | None, status: str | None, limit: int, as_json: bool) -> None:
    """List rollouts, newest first.

    Example: lightning-rl rollouts ls --store runs.db --status failed --json
    """
    with _open(store) as s:
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
                f"{_when(r.start_time)}"
            )
        if empty:
            click.echo(f"{empty} finished rollout(s) marked ! recorded no LLM call: they train nothing. If the agent "
                       "called a model, the call bypassed capture (lrl.stats(): llm_calls_bypassing_capture); send it "
                       "through the gateway or the openai client", err=True)


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
@_errors
def rollouts_expire(store: str | None, idle: float, origin: str | None) -> None:
    """End as timed_out the running rollouts nothing reached for --idle seconds (their process was killed).

    A gateway does this for its own on start; this is for the rest (a traced agent's process killed outright).
    What they recorded stays. Make sure no live process still runs them: one that does gets its finish refused.

    Example: lightning-rl rollouts expire --idle 3600 --store runs.db
    """
    with _open(store) as s:
        ended = s.expire_idle_running(idle, origin=origin)
    for rollout_id in ended:
        click.echo(rollout_id)
    click.echo(f"{len(ended)} running rollout(s) idle for {idle:g} s or more ended as timed_out", err=True)


@rollouts.command("show")
@click.argument("rollout_id")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--credit", default="final", show_default=True, help="Credit assignment for per-call rewards.")
@click.option("--json", "as_json", is_flag=True, help="The assembled trajectory as JSON.")
@_errors
def rollouts_show(rollout_id: str, store: str | None, credit: str, as_json: bool) -> None:
    """Show one rollout (its id, or the first characters of it that only it starts with): the conversation
    with tool calls, token counts and rewards.

    Example: lightning-rl rollouts show 3f2a9c1b07de --store runs.db
    """
    with _open(store) as s:
        t = s.trajectory(s.resolve_rollout_id(rollout_id), credit=credit)
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
        click.echo(f"  tool {a.get('gen_ai.tool.name')} id={a.get('gen_ai.tool.call.id')} status={span.status_code}")
    if t.missing_token_ids:
        click.echo(f"  warning: {t.missing_token_ids} LLM call(s) have no engine token ids and cannot be trained on")
    for r in t.rewards:
        where = f"call {r.llm_call_index}" if r.llm_call_index is not None else "rollout"
        click.echo(f"  reward {r.name}={r.value} ({r.source.value}, {where}{', agent ' + r.agent if r.agent else ''})")


@main.command("export")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--format", "fmt", type=click.Choice(["tokens", "jsonl", "chat"]), default="tokens", show_default=True,
              help="tokens (alias jsonl): training samples with the engine's token ids and masks; chat: "
                   "conversations with tools and tool calls, as TRL's SFTTrainer and chat templates read them.")
@click.option("--level", type=click.Choice(["call", "trajectory"]), default="call", show_default=True,
              help="tokens: one sample per LLM call, or per trajectory (merged by exact token prefix).")
@click.option("--credit", default="final", show_default=True, help="tokens: final, discounted, per_step, ...")
@click.option("--agents", default=None, help="Regex of agent names to keep (full match).")
@click.option("--mode", type=click.Choice(["train", "eval", "prod"]), default=None)
@click.option("--min-policy-version", type=int, default=None)
@click.option("--include-unrewarded", is_flag=True, help="tokens: also samples without a reward.")
@click.option("--min-reward", type=float, default=None, help="chat: only rollouts rewarded at least this.")
@click.option("--max-reward", type=float, default=None, help="chat: only rollouts rewarded at most this.")
@click.option("--best-of-group", is_flag=True, help="chat: the best-rewarded try of each group (rejection sampling).")
@click.option("-o", "--out", type=click.Path(dir_okay=False, allow_dash=True), default="-",
              help="Output file (default stdout); tokens ending in .parquet are written as Parquet.")
@_errors
def export(store, fmt, level, credit, agents, mode, min_policy_version, include_unrewarded, min_reward, max_reward,
           best_of_group, out) -> None:
    """Export succeeded rollouts as JSON lines: training samples (tokens) or conversations (chat).

    Example: lightning-rl export --format tokens --level trajectory --credit final -o samples.jsonl

    Example: lightning-rl export --format chat --min-reward 1 --best-of-group -o sft.jsonl

    Example: lightning-rl export --format tokens --min-policy-version 3 -o samples.parquet
    """
    import json as _json

    from .errors import ConfigurationError

    parquet = out.lower().endswith(".parquet")
    if parquet and fmt == "chat":
        raise ConfigurationError(f"-o {out!r}: conversations are written as JSON lines (their tool calls have no "
                                 "one table shape); name the file .jsonl, or export --format tokens as Parquet")
    if fmt == "chat":
        from .store.export import chat_examples

        with _open(store) as s:
            examples, stats = chat_examples(s, mode=mode, agents=agents, min_reward=min_reward, max_reward=max_reward,
                                            min_policy_version=min_policy_version, best_of_group=best_of_group)
        with click.open_file(out, "w") as f:
            for example in examples:
                f.write(_json.dumps(example, ensure_ascii=False) + "\n")
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(stats.skipped.items()))
        click.echo(f"exported {stats.examples} conversations from {stats.rollouts_read} succeeded rollouts"
                   + (f" (skipped: {skipped})" if skipped else ""), err=True)
        return
    if min_reward is not None or max_reward is not None or best_of_group:
        raise ConfigurationError("--min-reward, --max-reward and --best-of-group go with --format chat")
    with _open(store) as s:
        samples, stats = s.samples(
            level=level, agents=agents, include_unrewarded=include_unrewarded, credit=credit,
            mode=mode, min_policy_version=min_policy_version,
        )
    if not samples:
        raise ConfigurationError(
            f"the export matched no sample ({stats.splits} prefix splits, {stats.missing_token_ids} calls without "
            f"token ids, {stats.skipped_unrewarded} unrewarded skipped); loosen --mode, --agents or "
            "--min-policy-version, or add --include-unrewarded")
    if parquet:
        from .store.parquet import write_samples

        write_samples(samples, out)
    else:
        with click.open_file(out, "w") as f:
            for sample in samples:
                f.write(sample.model_dump_json() + "\n")
    click.echo(
        f"exported {stats.samples} samples ({stats.splits} prefix splits, {stats.missing_token_ids} calls "
        f"without token ids, {stats.skipped_unrewarded} unrewarded skipped)", err=True,
    )


@main.command("sft")
@click.option("--data", required=True, type=click.Path(dir_okay=False),
              help="JSON lines from lightning-rl export --format chat (or --format tokens).")
@click.option("--model-dir", required=True, type=click.Path(file_okay=False), help="The base model (served by vLLM).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for sft_adapter/ and sft.json.")
@click.option("--epochs", type=int, default=2, show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--policy", "policies", multiple=True, metavar="AGENT=SERVED",
              help="A team: each agent's policy, as in Trainer(policies=...); one adapter per policy. Repeat.")
@_errors
def sft(data: str, model_dir: str, out: str, epochs: int, lr: float, seed: int, policies: tuple[str, ...]) -> None:
    """Warm-start a LoRA from good traces (supervised), with the RL trainer's PEFT setup.

    Then train with Trainer(init_adapter=OUT/sft_adapter), or serve the adapter. With --policy (a team),
    each policy's adapter learns from its agents' examples, in OUT/sft_adapter/SERVED/.

    Example: lightning-rl export --format chat --min-reward 1 --best-of-group -o good.jsonl && lightning-rl sft --data good.jsonl --model-dir base/ --out .cache/sft
    """
    from pathlib import Path

    from .trainer_bridge.sft import warm_start

    Path(out).mkdir(parents=True, exist_ok=True)
    stats, path = warm_start(data, model_dir, out, seed=seed, epochs=epochs, lr=lr,
                             policies=_policy_map(policies) or None)
    click.echo(json.dumps(stats))
    click.echo(f"adapter written to {path}; train from it with Trainer(init_adapter={str(path)!r})", err=True)


@main.command("judge")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--base-url", required=True, help="The judge's OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.")
@click.option("--model", required=True, help="The judge's model name at that endpoint.")
@click.option("--rubric", default=None, help="What a good answer is (default: the judge's general rubric).")
@click.option("--mode", type=click.Choice(["train", "eval", "prod"]), default=None, help="Only rollouts of this mode.")
@click.option("--max-groups", type=int, default=None, help="Judge at most this many groups (oldest first).")
@click.option("--cache", default=None, type=click.Path(dir_okay=False), help="A JSON file of judged groups, kept across runs.")
@click.option("--unguided", is_flag=True, help="For endpoints without JSON-schema outputs: read the scores from the text.")
@_errors
def judge(store: str | None, base_url: str, model: str, rubric: str | None, mode: str | None,
          max_groups: int | None, cache: str | None, unguided: bool) -> None:
    """Reward stored rollouts that have none with an LLM judge, each group's tries scored together.

    The key is $OPENAI_API_KEY. Rollouts that have rewards keep them. A failed group stays unrewarded
    and is counted. Exits 1 when no succeeded rollout lacks a reward.

    Example: lightning-rl judge --store runs.db --mode prod --base-url http://127.0.0.1:8000/v1 --model judge --rubric "Score 1 for a correct, polite answer."
    """
    from .errors import ConfigurationError
    from .judge import DEFAULT_RUBRIC, GroupJudge, unrewarded_groups

    if max_groups is not None and max_groups < 1:
        raise ConfigurationError(f"--max-groups must be >= 1, got {max_groups}")
    grader = GroupJudge(base_url=base_url, model=model, rubric=rubric or DEFAULT_RUBRIC, cache_path=cache,
                        guided=not unguided)
    with _open(store) as s:
        groups, ungrouped = unrewarded_groups(s, mode=mode, max_groups=max_groups)
        if not groups:
            raise ConfigurationError(f"no group of succeeded rollouts without a reward{f' in mode {mode}' if mode else ''}"
                                     f" ({ungrouped} unrewarded rollouts have no group and cannot be compared)")
        done = grader.reward_groups(s, groups)
    click.echo(json.dumps({**done, "ungrouped_skipped": ungrouped, "judge_requests": grader.calls}))


@main.command("export-model")
@click.option("--adapter", required=True, type=click.Path(file_okay=False), help="A LoRA adapter folder the trainer published.")
@click.option("--merge", is_flag=True, help="Fold the adapter into the base model's weights (required).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="A new folder for the merged model.")
@click.option("--base-model", default=None, type=click.Path(file_okay=False),
              help="The base model folder (default: the one the adapter names).")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16.")
@_errors
def export_model(adapter: str, merge: bool, out: str, base_model: str | None, dtype: str) -> None:
    """Write a merged Hugging Face model (base + adapter) that vLLM serves as it is.

    Example: lightning-rl export-model --adapter .cache/demo-rl/adapters/v00020 --merge --out merged/
    """
    from .errors import ConfigurationError
    from .trainer_bridge.export_model import merge_adapter

    if not merge:
        raise ConfigurationError("export-model writes a merged model: add --merge (vLLM serves the adapter folder "
                                 "itself with --enable-lora --lora-modules NAME=DIR)")
    path = merge_adapter(adapter, out, base_model=base_model, dtype=dtype)
    click.echo(f"merged model written to {path} (serve it: vllm serve {path})", err=True)


@main.command("train", context_settings={"ignore_unknown_options": True})
@click.option("--backend", type=click.Choice(["local", "verl"]), default="local", show_default=True)
@click.option("--continuous", is_flag=True, help="local: train from production rollouts (mode prod) as rewards arrive.")
@click.option("--agent", default=None, help="verl: module:function of the traced agent.")
@click.option("--print-command", is_flag=True, help="verl: print the verl command instead of running it.")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--model-dir", default=None, help="local: the served base model (a Hugging Face directory).")
@click.option("--server-url", default=None, help="local: the vLLM server (started with --enable-lora).")
@click.option("--served-name", default="policy", show_default=True, help="local: the LoRA name agents call.")
@click.option("--out", default=".cache/continuous", show_default=True, help="local: adapters, state and metrics.")
@click.option("--min-new", type=int, default=32, show_default=True, help="local: fresh rewarded rollouts per update.")
@click.option("--max-policy-lag", type=int, default=2, show_default=True, help="local: drop rollouts older than this.")
@click.option("--reward-name", default="reward", show_default=True, help="local: e.g. user_feedback.")
@click.option("--lr", type=float, default=2e-4, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True,
              help="local: the agents' sampling temperature; log-probs are computed at it (calls sampled "
                   "otherwise are not trained on in --continuous mode).")
@click.option("--interval", type=float, default=10.0, show_default=True, help="local: seconds between checks.")
@click.option("--max-updates", type=int, default=None, help="local: stop after N updates (default: run forever).")
@click.option("--replay", "replay_store", default=None, metavar="STORE",
              help="local: train on the rollouts already in STORE, running no agent (the batches of the run "
                   "recorded there); adapters and metrics go to --out.")
@click.option("--seed", type=int, default=0, show_default=True, help="local: the trainer's seed (replay: the run's).")
@click.option("--steps", type=int, default=None, help="replay: stop after N updates (default: every batch).")
@click.option("--tasks-per-step", type=int, default=None,
              help="replay: groups per batch, for a store whose publishes do not say what they were trained on.")
@click.option("--max-staleness", type=int, default=0, show_default=True,
              help="replay: the run's max_staleness (samples more versions behind are dropped).")
@click.option("--credit", default="final", show_default=True, help="replay: the run's credit rule.")
@click.option("--level", type=click.Choice(["call", "trajectory"]), default="call", show_default=True)
@click.option("--policy", "policies", multiple=True, metavar="AGENT=SERVED",
              help="replay: a team's policy per agent, as in Trainer(policies=...); repeat for each agent.")
@click.option("--logger", "loggers", multiple=True, metavar="NAME",
              help="local: also log to an experiment tracker: tensorboard, mlflow or wandb (offline unless "
                   "WANDB_MODE/WANDB_API_KEY say otherwise); repeat for several. metrics.jsonl is always written.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@_errors
def train(backend, continuous, agent, print_command, store, model_dir, server_url, served_name, out, min_new,
          max_policy_lag, reward_name, lr, temperature, interval, max_updates, replay_store, seed, steps, tasks_per_step,
          max_staleness, credit, level, policies, loggers, overrides) -> None:
    """Train the served model: continuously from production traffic (local), or with verl; or replay a run.

    Example: lightning-rl train --continuous --store runs.db --model-dir base/ --server-url http://127.0.0.1:8000

    Example: lightning-rl train --replay runs.db --model-dir base/ --lr 1e-3 --out .cache/replay

    Example: lightning-rl train --backend verl --agent my_pkg.agents:solve data.train_files=tasks.parquet trainer.n_gpus_per_node=8

    Training over a task set on one machine is Python (Trainer.fit; see examples/calculator_rl/train.py).
    """
    from .errors import ConfigurationError

    if backend == "verl":
        import os
        import subprocess

        from .trainer_bridge.verl_launch import check_verl_version, check_vllm_version, verl_command

        if not agent:
            raise ConfigurationError("--backend verl needs --agent module:function (an importable traced agent)")
        command = verl_command(agent, overrides, store=store)
        if print_command:
            click.echo(" ".join(command))
            return
        check_verl_version()
        check_vllm_version()
        raise SystemExit(subprocess.call(command, env=os.environ.copy()))
    if overrides:
        raise ConfigurationError(f"unexpected arguments {list(overrides)!r}; Hydra overrides go with --backend verl")
    if replay_store is not None:
        if continuous:
            raise ConfigurationError("--replay trains on a stored run, --continuous on live traffic: give one")
        _replay(replay_store, model_dir=model_dir, out=out, served_name=served_name, lr=lr, temperature=temperature,
                seed=seed, steps=steps,
                tasks_per_step=tasks_per_step, max_staleness=max_staleness, credit=credit, level=level,
                policies=policies, loggers=loggers)
        return
    if not continuous:
        raise ConfigurationError(
            "the local backend trains from the command line in --continuous mode; train over a task set with "
            "Trainer.fit in Python (examples/calculator_rl/train.py)")
    if not model_dir or not server_url:
        raise ConfigurationError("--continuous needs --model-dir and --server-url")
    from .trainer_bridge.continuous import ContinuousTrainer
    from .trainer_bridge.local import LocalConfig

    trainer = ContinuousTrainer(
        store=_open(store), model_dir=model_dir, server_url=server_url, served_name=served_name, out_dir=out,
        min_new=min_new, max_policy_lag=max_policy_lag, reward_name=reward_name,
        local=LocalConfig(adv_estimator="batch_baseline", lr=lr, temperature=temperature), seed=seed,
        loggers=list(loggers),
    )
    trainer.start()
    click.echo(f"serving policy version {trainer.version} as {served_name!r}; waiting for {min_new} rewarded rollouts")
    trainer.run(interval=interval, max_updates=max_updates)


def _policy_map(policies: tuple[str, ...]) -> dict[str, str]:
    """``--policy AGENT=SERVED`` options as Trainer's policies= mapping."""
    from .errors import ConfigurationError

    team = {}
    for item in policies:
        name, sep, served = item.partition("=")
        if not sep or not name or not served:
            raise ConfigurationError(f"--policy {item!r} is not AGENT=SERVED (e.g. --policy planner=planner-lora)")
        team[name] = served
    return team


def _replay(replay_store: str, *, model_dir: str | None, out: str, served_name: str, lr: float, temperature: float,
            seed: int,
            steps: int | None, tasks_per_step: int | None, max_staleness: int, credit: str, level: str,
            policies: tuple[str, ...], loggers: tuple[str, ...] = ()) -> None:
    from pathlib import Path

    from .errors import ConfigurationError
    from .store.uri import open_store
    from .trainer_bridge.local import LocalConfig
    from .trainer_bridge.sources import StoredGroups
    from .trainer_bridge.trainer import Trainer

    if not model_dir:
        raise ConfigurationError("--replay needs --model-dir, the base model the run trained (its LoRA starts anew)")
    team = _policy_map(policies)
    source_store = _open(replay_store)
    if not team and served_name == "policy":  # the default: take the run's one served name
        names = sorted({p.served_name for p in source_store.policies()})
        if len(names) > 1:
            raise ConfigurationError(f"{replay_store} has publishes of {names}: a team; give --policy AGENT=SERVED "
                                     "for each agent, or --served-name for the one policy to replay")
        served_name = names[0] if names else served_name
    source = StoredGroups(source_store, credit=credit, tasks_per_step=tasks_per_step, steps=steps)
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.jsonl").unlink(missing_ok=True)
    record = open_store(f"sqlite:///{out_dir / 'replay.db'}")  # the replay's own publishes, not the run's store
    trainer = Trainer(agent=None, tasks=(), store=record, model_dir=model_dir, server_url=None, out_dir=out_dir,
                      served_name=served_name, policies=team or None, steps=len(source.batches), seed=seed,
                      credit=credit, level=level, max_staleness=max_staleness, source=source,
                      local=LocalConfig(lr=lr, temperature=temperature), progress=False, loggers=list(loggers))
    how = "what each publish was trained on" if source.from_lineage else f"train groups, {tasks_per_step} a batch"
    click.echo(f"replaying {len(source.batches)} batches from {replay_store} ({how})", err=True)
    result = trainer.fit()
    for line in result.history:
        click.echo(json.dumps({k: line.get(k) for k in ("step", "samples", "loss", "pg_clipfrac",
                                                        "samples_dropped_stale", "policy_version")}))
    record.close()


@main.group("store")
def store_group() -> None:
    """Serve a store over HTTP for many runner processes and machines; inspect and upgrade a store."""


@store_group.command("serve")
@click.option("--db", default="lightning_rl.db", show_default=True, help="The SQLite store file to serve.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs --token.")
@click.option("--port", type=int, default=8765, show_default=True)
@click.option("--token", envvar=ENV_STORE_TOKEN, default=None,
              help="Bearer token clients must send (default: $LIGHTNING_RL_STORE_TOKEN).")
@click.option("--max-body-mb", type=float, default=64, show_default=True, help="Largest request body accepted.")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Server processes on the port (they parse in parallel and share the SQLite file).")
@click.option("--synchronous", type=click.Choice(["full", "normal"]), default="full", show_default=True,
              help="full: an acknowledged batch survives a power loss (an fsync per commit); normal: a killed server.")
@click.option("--log-level", default="warning", show_default=True)
@_errors
def store_serve(db: str, host: str, port: int, token: str | None, max_body_mb: float, workers: int,
                synchronous: str, log_level: str) -> None:
    """Serve the store file over HTTP; clients set LIGHTNING_RL_STORE=http://HOST:PORT.

    Example: lightning-rl store serve --db runs.db --host 0.0.0.0 --port 8765 --token $TOKEN
    """
    from .serving import STORE_SERVER, check_bind
    from .store.server import serve

    check_bind(STORE_SERVER, host, token)
    click.echo(f"serving {db} on http://{host}:{port} (OpenAPI at /openapi.json)", err=True)
    serve(db, host=host, port=port, token=token, max_body_bytes=int(max_body_mb * 2**20), log_level=log_level,
          workers=workers, synchronous=synchronous)


@store_group.command("doctor")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Quarantined records shown.")
@click.option("--json", "as_json", is_flag=True, help="The report as one JSON object.")
@_errors
def store_doctor(store: str | None, limit: int, as_json: bool) -> None:
    """What a store holds that needs attention: records set aside in its quarantine (with the reason and
    the original record), spill files not yet written back, and this process's failure counters. Exits 1
    when something is there. Opens the store read-only: it writes nothing and replays nothing.

    Example: lightning-rl store doctor --store runs.db
    """
    from . import diagnostics

    opened = _open(store, read_only=True)
    try:
        quarantine = opened.quarantined(limit=limit)
        total = len(opened.quarantined(limit=2**62)) if len(quarantine) >= limit else len(quarantine)
        spills = [str(p) for p in getattr(opened, "spill_files", [])]
        report = {"store": opened.url, "quarantined": total, "spill_files": len(spills),
                  "quarantine": [q.model_dump(mode="json", exclude={"schema_version"}) for q in quarantine],
                  "spill": spills, "counters": diagnostics.counters()}
    finally:
        opened.close()
    if as_json:
        click.echo(json.dumps(report))
    else:
        if total:
            click.echo(f"{total} record(s) quarantined in {report['store']} (they could not be written; the rest "
                       "of their batches was). Newest first:")
            for q in quarantine:
                click.echo(f"  #{q.quarantine_id} {_when(q.time)} {q.kind} rollout={q.rollout_id or '-'}: {q.reason}")
                click.echo(f"      record: {q.payload[:300]}")
        else:
            click.echo(f"nothing quarantined in {report['store']}")
        if spills:
            click.echo(f"{len(spills)} spill file(s) not yet written back (the next process that opens the store "
                       f"for writing replays them): {', '.join(spills[:5])}")
    if total or spills:
        sys.exit(1)


@store_group.command("migrate")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--vacuum", is_flag=True, help="Then rewrite the file to give back the space it no longer uses "
              "(SQLite's VACUUM: needs as much free disk as the file, and no other process writing meanwhile).")
@_errors
def store_migrate(store: str | None, vacuum: bool) -> None:
    """Upgrade a SQLite store file written by an older lightning-rl to this version's schema, in place
    (what any command that opens it does, the listing and export ones too; the viewer, read-only, does not).
    A lightning-rl older than the schema can no longer open it afterwards.

    Example: lightning-rl store migrate --store runs.db --vacuum
    """
    import sqlite3
    from pathlib import Path

    from .store.migrations import latest_version
    from .store.sqlite_store import SQLiteStore

    opened = _open(store)
    opened.close()
    latest = latest_version()
    before = getattr(opened, "schema_found", None)
    if before and before < latest:
        click.echo(f"{opened.url}: upgraded from schema {before} to {latest}")
    else:
        click.echo(f"{opened.url}: schema {latest}, up to date")
    if vacuum and isinstance(opened, SQLiteStore):
        size = Path(opened.path).stat().st_size
        conn = sqlite3.connect(opened.path)
        try:
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
        click.echo(f"{opened.url}: vacuumed, {size:,} -> {Path(opened.path).stat().st_size:,} bytes")


@store_group.command("openapi")
def store_openapi() -> None:
    """Print the store server's OpenAPI document (JSON).

    Example: lightning-rl store openapi > store-openapi.json
    """
    from .store.server import openapi_schema

    click.echo(openapi_schema())


@main.command("gateway")
@click.option("--upstream", "upstreams", multiple=True, required=True,
              help="An OpenAI-compatible engine (vLLM), e.g. http://127.0.0.1:8000; repeat for several.")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs --token.")
@click.option("--port", type=int, default=8400, show_default=True)
@click.option("--token", envvar=ENV_GATEWAY_TOKEN, default=None,
              help="Bearer token for opening rollouts and late rewards (default: $LIGHTNING_RL_GATEWAY_TOKEN).")
@click.option("--idle-timeout", type=float, default=3600.0, show_default=True,
              help="End a rollout as timed out when no call, reward or finish reached it for this many seconds "
                   "(0: never).")
@click.option("--log-level", default="warning", show_default=True)
@_errors
def gateway(upstreams: tuple[str, ...], store: str | None, host: str, port: int, token: str | None,
            idle_timeout: float, log_level: str) -> None:
    """Trace agents in any language: an OpenAI-compatible proxy that records rollouts into the store.

    Open a rollout with POST /v1/rollouts; point the agent's OpenAI client at the base_url (or use the
    api_key) it answers with; end it with POST /v1/rollouts/{id}/finish.

    Example: lightning-rl gateway --upstream http://127.0.0.1:8000 --store runs.db --port 8400
    """
    from . import _api
    from .gateway import Gateway, serve
    from .serving import GATEWAY, check_bind

    check_bind(GATEWAY, host, token)
    proxy = Gateway(list(upstreams), token=token, idle_timeout=idle_timeout or None)  # bad upstreams are refused before the store is opened
    _api.configure(store=_open(store))
    click.echo(f"gateway on http://{host}:{port} in front of {', '.join(proxy.upstreams)}", err=True)
    serve(proxy, host=host, port=port, log_level=log_level)


@main.command("view")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--metrics", "metrics_dir", default=None, type=click.Path(file_okay=False),
              help="A folder with training runs' metrics.jsonl (searched below it) for the Training page.")
@click.option("--tokenizer", default=None, type=click.Path(file_okay=False),
              help="The served model's directory, to show token text (default: token ids).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Anything but loopback needs --token.")
@click.option("--port", type=int, default=8500, show_default=True)
@click.option("--token", envvar=ENV_VIEW_TOKEN, default=None,
              help="Required beyond loopback; open the viewer with ?token=... (default: $LIGHTNING_RL_VIEW_TOKEN).")
@_errors
def view(store: str | None, metrics_dir: str | None, tokenizer: str | None, host: str, port: int,
         token: str | None) -> None:
    """A read-only web UI over a store: rollouts, conversations, tokens, rewards, groups, training curves.

    Example: lightning-rl view --store runs.db --metrics .cache/demo-rl --tokenizer .cache/tiny-qwen2
    """
    from .serving import VIEWER, check_bind
    from .viewer.app import serve

    check_bind(VIEWER, host, token)
    opened = _open(store, read_only=True)  # the viewer never writes: no migration, no spill replay
    click.echo(f"viewer on http://{host}:{port} over {opened.url} (read-only)", err=True)
    serve(opened, host=host, port=port, metrics_dir=metrics_dir, tokenizer=tokenizer, token=token)


@main.command("runner")
@click.option("--agent", required=True, help="module:function of the traced agent to run on leased tasks.")
@click.option("--store", default=None, help=STORE_HELP + " Usually http://HOST:PORT of a store server.")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Tries run at once.")
@click.option("--lease-seconds", type=float, default=60.0, show_default=True,
              help="A try not heartbeaten for this long is given to another runner.")
@click.option("--rollout-timeout", type=float, default=120.0, show_default=True)
@click.option("--runner-id", default=None, help="Name in the queue (default: runner-PID-random).")
@click.option("--idle-exit", type=float, default=None, help="Exit after this many seconds with nothing to do.")
@click.option("--max-rollouts", type=int, default=None, help="Exit after running this many tries.")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="Write a JSON report at exit (tries run, store write latencies).")
@_errors
def runner(agent, store, concurrency, lease_seconds, rollout_timeout, runner_id, idle_exit, max_rollouts,
           report) -> None:
    """Run tries of the store's task queue with a traced agent, until stopped.

    Example: LIGHTNING_RL_STORE=http://10.0.0.5:8765 lightning-rl runner --agent my_pkg.agents:solve
    """
    import signal

    from ._api import configure, stats
    from .trainer_bridge.runner import Runner, load_agent

    opened = configure(store=store) if store else configure()
    worker = Runner(opened, load_agent(agent), runner_id=runner_id, concurrency=concurrency,
                    lease_seconds=lease_seconds, rollout_timeout=rollout_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    click.echo(f"{worker.runner_id}: running {agent} on tasks from {opened.url}", err=True)
    with worker:
        ran = worker.serve(idle_exit=idle_exit, max_rollouts=max_rollouts)
    opened.flush()
    click.echo(f"{worker.runner_id}: ran {ran} tries", err=True)
    if report:
        latencies = list(getattr(opened, "latencies", []))
        with open(report, "w") as f:
            json.dump({"runner": worker.runner_id, "ran": ran, "write_latencies_s": latencies,
                       "counters": stats()}, f)


@main.command("plot")
@click.argument("metrics", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", default="reward.png", show_default=True)
@_errors
def plot(metrics: str, out: str) -> None:
    """Draw reward against step from a metrics.jsonl written by a training run.

    Example: lightning-rl plot .cache/demo-rl/metrics.jsonl -o reward.png
    """
    from .trainer_bridge.trainer import plot_metrics

    click.echo(str(plot_metrics(metrics, out)))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
