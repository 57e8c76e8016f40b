"""``lightning-rl train``: one subcommand per way to train, each over one public call.

``train run`` -> ``Trainer(...).fit()`` over a task set; ``train continuous`` ->
``ContinuousTrainer(...).run()`` on production traffic; ``train replay`` -> ``trainer_bridge.replay``
on a stored run; ``train verl`` -> ``trainer_bridge.verl.launch.run_verl``.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigurationError
from ._common import STORE_HELP, errors, gate_test_options, open_store, policy_map

LOGGER_HELP = ("Also log to an experiment tracker: tensorboard, mlflow or wandb (offline unless WANDB_MODE/"
               "WANDB_API_KEY say otherwise); repeat for several. metrics.jsonl is always written.")
POLICY_HELP = "A team: an agent's policy, as in Trainer(policies=...); repeat for each agent."
TEMPERATURE_HELP = "The agents' sampling temperature: the trainer computes log-probs at it."
DTYPE_HELP = ("The local trainer's weights and compute: float32, or bfloat16 on a GPU (its log-probs then differ from the "
              "engine's: docs/verl.md measures the gap).")
DTYPES = click.Choice(["float32", "bfloat16", "float16"])


@click.group("train")
def train() -> None:
    """Train the served model: over a task set, from production traffic, on a stored run, or with verl.

    Example: lightning-rl train run --agent my_pkg.agents:solve --tasks tasks.jsonl --model-dir base/ --server-url http://127.0.0.1:8000
    """


def read_tasks(path: str) -> list[Any]:
    """The tasks of a JSON-lines file, one JSON value a line (blank lines skipped)."""
    tasks = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ConfigurationError(f"{path}:{n} is not a JSON value ({exc}); give one task per line") from None
    if not tasks:
        raise ConfigurationError(f"{path} holds no task; give one JSON value per line")
    return tasks


@train.command("run")
@click.option("--agent", required=True, help="module:function of the traced agent (sync or async).")
@click.option("--tasks", "tasks_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="JSON lines, one task a line (what the agent is called with).")
@click.option("--eval-tasks", "eval_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Held-out tasks (JSON lines), run before and after training (mode eval).")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--model-dir", required=True, type=click.Path(file_okay=False), help="The served base model.")
@click.option("--server-url", required=True, help="The vLLM server the agent calls (started with --enable-lora); "
              "replicas: a comma list, each gets every publish.")
@click.option("--served-name", default="policy", show_default=True, help="The LoRA name the agent calls.")
@click.option("--weights", type=click.Choice(["lora", "full"]), default="lora", show_default=True,
              help="What each step publishes: the LoRA, hot-loaded under --served-name; or full, the merged model "
              "reloaded into vLLM started with VLLM_SERVER_DEV_MODE=1 (--served-name: the base model's served "
              "name; docs/fleet.md, Full weights).")
@click.option("--policy", "policies", multiple=True, metavar="AGENT=SERVED", help=POLICY_HELP)
@click.option("--out", default=".cache/train", show_default=True, help="Adapters, metrics.jsonl and reward.png.")
@click.option("--n", type=int, default=8, show_default=True, help="Tries per task (a GRPO group).")
@click.option("--tasks-per-step", type=int, default=8, show_default=True, help="Groups per update.")
@click.option("--steps", type=int, default=20, show_default=True, help="Updates.")
@click.option("--lr", type=float, default=2e-4, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True, help=TEMPERATURE_HELP)
@click.option("--dtype", type=DTYPES, default="float32", show_default=True, help=DTYPE_HELP)
@click.option("--credit", default="final", show_default=True, help="Credit assignment of per-call rewards.")
@click.option("--level", type=click.Choice(["call", "trajectory"]), default="call", show_default=True)
@click.option("--concurrency", type=int, default=16, show_default=True, help="Tries run at once.")
@click.option("--overlap", is_flag=True, help="Keep rollouts running while the trainer updates.")
@click.option("--max-staleness", type=int, default=None, help="Versions a sample may be behind (default: 1 with "
              "--overlap, else 0).")
@click.option("--init-adapter", default=None, type=click.Path(exists=True, file_okay=False),
              help="Start from this LoRA (what lightning-rl sft writes).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--logger", "loggers", multiple=True, metavar="NAME", help=LOGGER_HELP)
@errors
def train_run(agent, tasks_path, eval_path, store, model_dir, server_url, served_name, weights, policies, out, n,
              tasks_per_step, steps, lr, temperature, dtype, credit, level, concurrency, overlap, max_staleness,
              init_adapter, seed, loggers) -> None:
    """Train over a task set: each step runs every task n times and updates the LoRA (Trainer.fit).

    Prints the run's summary as JSON; each step's line is in OUT/metrics.jsonl.

    Example: lightning-rl train run --agent my_pkg.agents:solve --tasks tasks.jsonl --eval-tasks held_out.jsonl --model-dir base/ --server-url http://127.0.0.1:8000 --steps 20
    """
    from .. import _api
    from ..trainer_bridge.config import LocalConfig
    from ..trainer_bridge.agent_loading import load_agent
    from ..trainer_bridge.trainer import Trainer

    solve = load_agent(agent)
    tasks, held_out = read_tasks(tasks_path), read_tasks(eval_path) if eval_path else []
    team = policy_map(policies) or None
    publisher = None
    if weights == "full":
        if team:
            raise ConfigurationError(f"--weights full publishes one model, and --policy {policies[0]} asks for a LoRA per "
                                     "agent; drop --policy, or train LoRAs (--weights lora)")
        from ..trainer_bridge.publishers import make_publisher
        publisher = make_publisher("vllm_full", server_url=server_url, served_name=served_name,
                                   weights_dir=Path(out) / "weights")
    opened = open_store(store)
    try:
        trainer = Trainer(agent=solve, tasks=tasks, eval_tasks=held_out, store=opened, model_dir=model_dir,
                          server_url=server_url, served_name=served_name, policies=team, out_dir=out, n=n,
                          publisher=publisher,
                          tasks_per_step=tasks_per_step, steps=steps, credit=credit, level=level,
                          concurrency=concurrency, overlap=overlap, max_staleness=max_staleness,
                          init_adapter=init_adapter, seed=seed, local=LocalConfig(lr=lr, temperature=temperature, dtype=dtype),
                          loggers=list(loggers))
    except BaseException:
        opened.close()
        raise
    if not (Path(model_dir) / "config.json").is_file():
        opened.close()
        raise ConfigurationError(f"--model-dir {model_dir} has no config.json: give the folder of the served base "
                                 "model (what vLLM was started with, a transformers save_pretrained folder)")
    _api.configure(store=opened)  # the agent's spans go to the store fit reads
    result = trainer.fit()
    opened.flush()
    trained = [x for x in result.history if "train_reward" in x]
    click.echo(json.dumps({"steps": len(trained), "train_reward_first": trained[0]["train_reward"] if trained else None,
                           "train_reward_last": trained[-1]["train_reward"] if trained else None,
                           "eval_before": result.eval_before, "eval_after": result.eval_after,
                           "metrics": str(result.metrics_path), "plot": str(result.plot_path)}))


@train.command("continuous")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--model-dir", required=True, type=click.Path(file_okay=False), help="The served base model.")
@click.option("--server-url", required=True, help="The vLLM server (started with --enable-lora); replicas: a comma "
              "list, each gets every publish and is reconciled at every check.")
@click.option("--served-name", default="policy", show_default=True, help="The LoRA name agents call.")
@click.option("--out", default=".cache/continuous", show_default=True, help="Adapters, state and metrics.")
@click.option("--min-new", type=int, default=32, show_default=True, help="Fresh rewarded rollouts per update.")
@click.option("--max-policy-lag", type=int, default=2, show_default=True, help="Drop rollouts older than this.")
@click.option("--reward-name", default="reward", show_default=True, help="e.g. user_feedback.")
@click.option("--lr", type=float, default=2e-4, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True,
              help=TEMPERATURE_HELP + " Calls sampled otherwise are not trained on.")
@click.option("--dtype", type=DTYPES, default="float32", show_default=True, help=DTYPE_HELP)
@click.option("--interval", type=float, default=10.0, show_default=True, help="Seconds between checks.")
@click.option("--max-updates", type=int, default=None, help="Stop after N updates (default: run forever).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--logger", "loggers", multiple=True, metavar="NAME", help=LOGGER_HELP)
@click.option("--gate-tasks", "gate_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="Held-out tasks (JSON lines): each update goes live only if not worse on them than the live policy.")
@click.option("--gate-agent", default=None, help="module:function of the traced agent that runs the gate tasks "
              "(it calls the model lrl.current_endpoint() names).")
@gate_test_options
@click.option("--rollback-watch", is_flag=True, help="After each publish, restore the previous version when production "
              "reward drops beyond --gate-margin at --gate-confidence (the gate's test, from above).")
@click.option("--watch-min-rollouts", type=int, default=16, show_default=True,
              help="Rewarded production rollouts of a new version before the watch judges it.")
@click.option("--canary", type=float, default=0.0, show_default=True, metavar="SHARE",
              help="Before going live, serve each candidate to this share of production rollouts (e.g. 0.1) under "
              "<served-name>-candidate, and publish it only if its production reward is not worse (the gate's test).")
@click.option("--canary-min-rollouts", type=int, default=16, show_default=True,
              help="Rewarded canary rollouts before the canary is judged.")
@click.option("--canary-timeout", type=float, default=600.0, show_default=True,
              help="Seconds a canary may wait for its feedback; a candidate short of it then is refused.")
@errors
def train_continuous(store, model_dir, server_url, served_name, out, min_new, max_policy_lag, reward_name, lr,
                     temperature, dtype, interval, max_updates, seed, loggers, gate_path, gate_agent, gate_n, gate_margin,
                     gate_confidence, rollback_watch, watch_min_rollouts, canary, canary_min_rollouts,
                     canary_timeout) -> None:
    """Keep training the served LoRA from production rollouts (mode prod) as their rewards arrive.

    With --gate-tasks and --gate-agent, each update is a candidate evaluated beside the live policy and
    published only when not worse; with --canary SHARE, each candidate serves that share of production
    first and is published only when its production reward is not worse; with --rollback-watch, a
    published version whose production reward drops is replaced by the one before
    (docs/continuous-safety.md).

    Example: lightning-rl train continuous --store runs.db --model-dir base/ --server-url http://127.0.0.1:8000 --reward-name user_feedback --gate-tasks held_out.jsonl --gate-agent my_pkg.agents:solve
    """
    from .. import _api
    from ..trainer_bridge.config import LocalConfig
    from ..trainer_bridge.continuous import ContinuousTrainer
    from ..trainer_bridge.agent_loading import load_agent

    if bool(gate_path) != bool(gate_agent):
        raise ConfigurationError("the gate needs both --gate-tasks FILE and --gate-agent module:function; got only "
                                 f"{'--gate-tasks' if gate_path else '--gate-agent'}")
    gate_tasks, solve = (read_tasks(gate_path), load_agent(gate_agent)) if gate_path else ((), None)
    opened = open_store(store)
    try:
        trainer = ContinuousTrainer(
            store=opened, model_dir=model_dir, server_url=server_url, served_name=served_name, out_dir=out,
            min_new=min_new, max_policy_lag=max_policy_lag, reward_name=reward_name,
            local=LocalConfig(adv_estimator="batch_baseline", lr=lr, temperature=temperature, dtype=dtype), seed=seed,
            loggers=list(loggers), gate_tasks=gate_tasks, gate_agent=solve, gate_n=gate_n, gate_margin=gate_margin,
            gate_confidence=gate_confidence, rollback_watch=rollback_watch, watch_min_rollouts=watch_min_rollouts,
            canary=canary, canary_min_rollouts=canary_min_rollouts, canary_timeout=canary_timeout)
    except BaseException:
        opened.close()
        raise
    if solve is not None:
        _api.configure(store=opened)  # the gate agent's spans go to the store the gate reads
    try:
        trainer.start()
        click.echo(f"serving policy version {trainer.version} as {served_name!r}; waiting for {min_new} rewarded "
                   "rollouts")
        trainer.run(interval=interval, max_updates=max_updates)
    finally:  # Ctrl-C too: a canary in progress ends now (refused), its routing with it
        trainer.close()
        opened.close()


@train.command("replay")
@click.argument("run_store", metavar="STORE")
@click.option("--model-dir", required=True, type=click.Path(file_okay=False),
              help="The base model the run trained (its LoRA starts anew).")
@click.option("--out", default=".cache/replay", show_default=True, help="Adapters and metrics of the replay.")
@click.option("--served-name", default=None, help="The policy to replay (default: the run's one served name).")
@click.option("--policy", "policies", multiple=True, metavar="AGENT=SERVED", help=POLICY_HELP)
@click.option("--lr", type=float, default=2e-4, show_default=True)
@click.option("--temperature", type=float, default=1.0, show_default=True, help=TEMPERATURE_HELP)
@click.option("--dtype", type=DTYPES, default="float32", show_default=True, help=DTYPE_HELP)
@click.option("--seed", type=int, default=0, show_default=True, help="The run's seed.")
@click.option("--steps", type=click.IntRange(min=1), default=None, help="Stop after N updates (default: every batch).")
@click.option("--tasks-per-step", type=int, default=None,
              help="Groups per batch, for a store whose publishes do not say what they were trained on.")
@click.option("--max-staleness", type=int, default=0, show_default=True,
              help="The run's max_staleness (samples more versions behind are dropped).")
@click.option("--credit", default="final", show_default=True, help="The run's credit rule.")
@click.option("--level", type=click.Choice(["call", "trajectory"]), default="call", show_default=True)
@click.option("--logger", "loggers", multiple=True, metavar="NAME", help=LOGGER_HELP)
@errors
def train_replay(run_store, model_dir, out, served_name, policies, lr, temperature, dtype, seed, steps, tasks_per_step,
                 max_staleness, credit, level, loggers) -> None:
    """Train a fresh LoRA on the batches of a run recorded in STORE, running no agent.

    Prints each update's figures as a JSON line; adapters and metrics.jsonl go to --out.

    Example: lightning-rl train replay runs.db --model-dir base/ --lr 1e-3 --seed 3 --out .cache/replay
    """
    from ..trainer_bridge.config import LocalConfig
    from ..trainer_bridge.replay import replay

    result = replay(run_store, model_dir=model_dir, out_dir=out, served_name=served_name,
                    policies=policy_map(policies) or None, local=LocalConfig(lr=lr, temperature=temperature, dtype=dtype),
                    seed=seed, steps=steps, tasks_per_step=tasks_per_step, max_staleness=max_staleness,
                    credit=credit, level=level, loggers=list(loggers))
    for line in result.history:
        click.echo(json.dumps({k: line.get(k) for k in ("step", "samples", "loss", "pg_clipfrac",
                                                        "samples_dropped_stale", "policy_version")}))
    click.echo(f"replayed {len(result.history)} batches from {run_store} into {out}", err=True)


@train.command("verl", context_settings={"ignore_unknown_options": True})
@click.option("--agent", default=None, help="module:function of the traced agent verl's workers run (not needed with "
              "lightning_rl.rollouts=external: runners elsewhere run it).")
@click.option("--store", default=None, help=STORE_HELP + " Several nodes: http://HOST:PORT of a store server.")
@click.option("--tasks", "tasks_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSON lines, one task a line: written as verl's training parquet (data.train_files).")
@click.option("--val-tasks", "val_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="JSON lines of validation tasks (data.val_files); without them verl does not validate.")
@click.option("--data-dir", default="lightning_rl_verl_data", show_default=True, type=click.Path(file_okay=False),
              help="Where --tasks and --val-tasks are written as parquet.")
@click.option("--print-command", is_flag=True, help="Print the verl command instead of running it.")
@click.argument("overrides", nargs=-1, type=click.UNPROCESSED)
@errors
def train_verl(agent, store, tasks_path, val_path, data_dir, print_command, overrides) -> None:
    """Train with verl (Ray, GPUs): verl's own trainer over the traced agent, with the packaged Hydra config.

    Any Hydra override can follow (trainer.n_gpus_per_node=8, actor_rollout_ref.model.path=..., ...). Refused in
    one line before anything starts: verl's legacy trainer (trainer.use_v1=false), its async modes
    (trainer.v1.trainer_mode other than sync), a rollout engine other than vllm, a LoRA without
    actor_rollout_ref.model.lora.merge=true, several nodes on a SQLite store, an agent that does not import,
    dataset files that do not exist. --print-command checks the settings where verl is installed. More: docs/verl.md
    in the source.

    Example: lightning-rl train verl --agent my_pkg.agents:solve --tasks tasks.jsonl --val-tasks held_out.jsonl actor_rollout_ref.model.path=Qwen/Qwen2.5-1.5B-Instruct trainer.n_gpus_per_node=8
    """
    from ..store.uri import redacted
    from ..trainer_bridge.verl.launch import (check_verl_config, composed_config, data_overrides, launch_store,
                                              run_verl, verl_command)

    if val_path and not tasks_path:
        raise ConfigurationError("--val-tasks needs --tasks too (or give data.train_files= and data.val_files=)")
    tasks = read_tasks(tasks_path) if tasks_path else None
    val_tasks = read_tasks(val_path) if val_path else None
    if print_command:
        data = data_overrides(tasks, val_tasks, data_dir, overrides)
        command = verl_command(agent, [*overrides, *data], store=store)
        try:  # where verl is installed, the command is checked as the launch will check it
            import hydra  # noqa: F401
            import verl  # noqa: F401
        except ImportError:
            click.echo("(verl is not installed here: the configuration is checked when the command runs)", err=True)
        else:  # the settings only: the agent and the data files are the running machine's (it may be another)
            check_verl_config(composed_config(command))
        # the store goes in the environment, never in verl's config (verl prints it); its password is not shown
        click.echo(f"LIGHTNING_RL_STORE={shlex.quote(redacted(launch_store(store)))} " + " ".join(command))
        return
    raise SystemExit(run_verl(agent, overrides, store=store, tasks=tasks, val_tasks=val_tasks, data_dir=data_dir))
