"""Commands over stored data: ``export``, ``sft``, ``judge``, ``export-model``, ``plot``."""

from __future__ import annotations

import json

import click

from ..errors import ConfigurationError
from ._common import STORE_HELP, errors, open_store, policy_map

@click.command("export")
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
@errors
def export(store, fmt, level, credit, agents, mode, min_policy_version, include_unrewarded, min_reward, max_reward,
           best_of_group, out) -> None:
    """Export succeeded rollouts as JSON lines: training samples (tokens) or conversations (chat).

    Example: lightning-rl export --format tokens --level trajectory --credit final -o samples.jsonl

    Example: lightning-rl export --format chat --min-reward 1 --best-of-group -o sft.jsonl

    Example: lightning-rl export --format tokens --min-policy-version 3 -o samples.parquet
    """
    parquet = out.lower().endswith(".parquet")
    if parquet and fmt == "chat":
        raise ConfigurationError(f"-o {out!r}: conversations are written as JSON lines (their tool calls have no "
                                 "one table shape); name the file .jsonl, or export --format tokens as Parquet")
    if fmt == "chat":
        from ..store.export import chat_examples

        with open_store(store) as s:
            examples, stats = chat_examples(s, mode=mode, agents=agents, min_reward=min_reward, max_reward=max_reward,
                                            min_policy_version=min_policy_version, best_of_group=best_of_group)
        with click.open_file(out, "w") as f:
            for example in examples:
                f.write(json.dumps(example, ensure_ascii=False) + "\n")
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(stats.skipped.items()))
        click.echo(f"exported {stats.examples} conversations from {stats.rollouts_read} succeeded rollouts"
                   + (f" (skipped: {skipped})" if skipped else ""), err=True)
        return
    if min_reward is not None or max_reward is not None or best_of_group:
        raise ConfigurationError("--min-reward, --max-reward and --best-of-group go with --format chat")
    from ..store import samples as read_samples

    with open_store(store) as s:
        samples, stats = read_samples(
            s, level=level, agents=agents, include_unrewarded=include_unrewarded, credit=credit,
            mode=mode, min_policy_version=min_policy_version,
        )
    if not samples:
        raise ConfigurationError(
            f"the export matched no sample ({stats.splits} prefix splits, {stats.missing_token_ids} calls without "
            f"token ids, {stats.skipped_unrewarded} unrewarded skipped); loosen --mode, --agents or "
            "--min-policy-version, or add --include-unrewarded")
    if parquet:
        from ..store.parquet import write_samples

        write_samples(samples, out)
    else:
        with click.open_file(out, "w") as f:
            for sample in samples:
                f.write(sample.model_dump_json() + "\n")
    click.echo(
        f"exported {stats.samples} samples ({stats.splits} prefix splits, {stats.missing_token_ids} calls "
        f"without token ids, {stats.skipped_unrewarded} unrewarded skipped)", err=True,
    )


@click.command("sft")
@click.option("--data", required=True, type=click.Path(dir_okay=False),
              help="JSON lines from lightning-rl export --format chat (or --format tokens).")
@click.option("--model-dir", required=True, type=click.Path(file_okay=False), help="The base model (served by vLLM).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for sft_adapter/ and sft.json.")
@click.option("--epochs", type=int, default=2, show_default=True)
@click.option("--lr", type=float, default=1e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--policy", "policies", multiple=True, metavar="AGENT=SERVED",
              help="A team: each agent's policy, as in Trainer(policies=...); one adapter per policy. Repeat.")
@errors
def sft(data: str, model_dir: str, out: str, epochs: int, lr: float, seed: int, policies: tuple[str, ...]) -> None:
    """Warm-start a LoRA from good traces (supervised), with the RL trainer's PEFT setup.

    Then train with Trainer(init_adapter=OUT/sft_adapter), or serve the adapter. With --policy (a team),
    each policy's adapter learns from its agents' examples, in OUT/sft_adapter/SERVED/.

    Example: lightning-rl export --format chat --min-reward 1 --best-of-group -o good.jsonl && lightning-rl sft --data good.jsonl --model-dir base/ --out .cache/sft
    """
    from pathlib import Path

    from ..trainer_bridge.policies import Policies
    from ..trainer_bridge.sft import warm_start

    Path(out).mkdir(parents=True, exist_ok=True)
    stats, path = warm_start(data, model_dir, out, seed=seed, epochs=epochs, lr=lr,
                             policies=Policies.of(policy_map(policies) or None))
    click.echo(json.dumps(stats))
    click.echo(f"adapter written to {path}; train from it with Trainer(init_adapter={str(path)!r})", err=True)


@click.command("judge")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--base-url", required=True, help="The judge's OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.")
@click.option("--model", required=True, help="The judge's model name at that endpoint.")
@click.option("--rubric", default=None, help="What a good answer is (default: the judge's general rubric).")
@click.option("--mode", type=click.Choice(["train", "eval", "prod"]), default=None, help="Only rollouts of this mode.")
@click.option("--max-groups", type=int, default=None, help="Judge at most this many groups (oldest first).")
@click.option("--cache", default=None, type=click.Path(dir_okay=False), help="A JSON file of judged groups, kept across runs.")
@click.option("--unguided", is_flag=True, help="For endpoints without JSON-schema outputs: read the scores from the text.")
@errors
def judge(store: str | None, base_url: str, model: str, rubric: str | None, mode: str | None,
          max_groups: int | None, cache: str | None, unguided: bool) -> None:
    """Reward stored rollouts that have none with an LLM judge, each group's tries scored together.

    The key is $OPENAI_API_KEY. Rollouts that have rewards keep them. A failed group stays unrewarded
    and is counted. Exits 1 when no succeeded rollout lacks a reward.

    Example: lightning-rl judge --store runs.db --mode prod --base-url http://127.0.0.1:8000/v1 --model judge --rubric "Score 1 for a correct, polite answer."
    """
    from ..judge import DEFAULT_RUBRIC, GroupJudge, unrewarded_groups

    if max_groups is not None and max_groups < 1:
        raise ConfigurationError(f"--max-groups must be >= 1, got {max_groups}")
    grader = GroupJudge(base_url=base_url, model=model, rubric=rubric or DEFAULT_RUBRIC, cache_path=cache,
                        guided=not unguided)
    with open_store(store) as s:
        groups, ungrouped = unrewarded_groups(s, mode=mode, max_groups=max_groups)
        if not groups:
            raise ConfigurationError(f"no group of succeeded rollouts without a reward{f' in mode {mode}' if mode else ''}"
                                     f" ({ungrouped} unrewarded rollouts have no group and cannot be compared)")
        done = grader.reward_groups(s, groups)
    click.echo(json.dumps({**done, "ungrouped_skipped": ungrouped, "judge_requests": grader.calls}))


@click.command("export-model")
@click.option("--adapter", default=None, type=click.Path(file_okay=False), help="A LoRA adapter folder the trainer published.")
@click.option("--verl-checkpoint", default=None, type=click.Path(file_okay=False),
              help="A verl checkpoint (trainer.default_local_dir/global_step_N): OUT gets merged/ and, for a LoRA run, "
                   "adapter/.")
@click.option("--merge", is_flag=True, help="Fold the adapter into the base model's weights (required with --adapter).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="A new folder for what is written.")
@click.option("--base-model", default=None, type=click.Path(file_okay=False),
              help="The base model folder (default: the one the adapter, or the verl run's record, names).")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16.")
@errors
def export_model(adapter: str | None, verl_checkpoint: str | None, merge: bool, out: str, base_model: str | None,
                 dtype: str) -> None:
    """Write a merged Hugging Face model (base + adapter) that vLLM serves as it is; from a verl checkpoint, also
    its LoRA adapter, which `policies promote` takes through the gate to a served vLLM.

    Example: lightning-rl export-model --adapter .cache/demo-rl/adapters/v00020 --merge --out merged/

    Example: lightning-rl export-model --verl-checkpoint checkpoints/run/global_step_20 --out exported/
    """
    if (adapter is None) == (verl_checkpoint is None):
        raise ConfigurationError("give one of --adapter DIR (a published LoRA) or --verl-checkpoint DIR (a verl run's "
                                 "global_step_N)")
    if verl_checkpoint is not None:
        from ..trainer_bridge.verl.export import export_verl_checkpoint

        written = export_verl_checkpoint(verl_checkpoint, out, base_model=base_model, dtype=dtype)
        click.echo(json.dumps({k: str(v) if v is not None else None for k, v in written.items()}))
        return
    from ..trainer_bridge.export_model import merge_adapter

    if not merge:
        raise ConfigurationError("export-model writes a merged model: add --merge (vLLM serves the adapter folder "
                                 "itself with --enable-lora --lora-modules NAME=DIR)")
    path = merge_adapter(adapter, out, base_model=base_model, dtype=dtype)
    click.echo(f"merged model written to {path} (serve it: vllm serve {path})", err=True)


@click.command("plot")
@click.argument("metrics", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", default="reward.png", show_default=True)
@errors
def plot(metrics: str, out: str) -> None:
    """Draw reward against step from a metrics.jsonl written by a training run.

    Example: lightning-rl plot .cache/demo-rl/metrics.jsonl -o reward.png
    """
    from ..trainer_bridge.plotting import plot_metrics

    click.echo(str(plot_metrics(metrics, out)))
