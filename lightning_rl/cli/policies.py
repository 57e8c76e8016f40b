"""``lightning-rl policies``: the served names' policies in a store (``policies rollback``, ``policies promote``)."""

from __future__ import annotations

import json

import click

from ..settings import ENV_BASE_URL
from ._common import STORE_HELP, errors, gate_test_options, open_store


@click.group("policies")
def policies() -> None:
    """The policies a store records for each served name: promote a candidate through the gate, roll one back.

    Example: lightning-rl policies rollback --to 3 --store runs.db --server-url http://127.0.0.1:8000
    """


@policies.command("rollback")
@click.option("--to", "version", type=int, required=True, help="The version to make live again.")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--server-url", envvar=ENV_BASE_URL, required=True,
              help=f"The vLLM server that serves the policy (default: ${ENV_BASE_URL}).")
@click.option("--served-name", default="policy", show_default=True, help="The LoRA name agents call.")
@click.option("--reason", default="by hand", show_default=True, help="Why, kept with the decision.")
@errors
def rollback(version, store, server_url, served_name, reason) -> None:
    """Load an earlier version's adapter into the server under the live name, and record it (publish and decision).

    A running `train continuous` goes on from that version at its next step. Prints the publish as JSON.

    Example: lightning-rl policies rollback --to 3 --store runs.db --server-url http://127.0.0.1:8000 --served-name policy
    """
    from ..trainer_bridge.rollback import rollback as roll_back

    with open_store(store) as opened:
        record = roll_back(opened, to=version, server_url=server_url, served_name=served_name, reason=reason)
    click.echo(json.dumps({"served_name": record.served_name, "version": record.version, "adapter": record.adapter}))


@policies.command("promote")
@click.option("--adapter", required=True, type=click.Path(exists=True, file_okay=False),
              help="The candidate LoRA folder (e.g. export-model --verl-checkpoint's adapter/).")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--server-url", envvar=ENV_BASE_URL, required=True,
              help=f"The vLLM server that serves the policy, with --enable-lora --max-loras 2 (default: ${ENV_BASE_URL}).")
@click.option("--served-name", default="policy", show_default=True, help="The live name agents call.")
@click.option("--gate-tasks", "gate_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Held-out tasks (JSON lines) both policies are judged on.")
@click.option("--gate-agent", required=True, help="module:function of the traced agent that runs them (it calls the "
              "model lrl.current_endpoint() names).")
@gate_test_options
@errors
def promote(adapter, store, server_url, served_name, gate_path, gate_agent, gate_n, gate_margin,
            gate_confidence) -> None:
    """Judge a candidate adapter beside the live policy on held-out tasks; publish it only if not worse.

    Prints the decision and the gate's figures as JSON; exits 0 when promoted, 3 when the gate refused it.

    Example: lightning-rl policies promote --adapter exported/adapter --store runs.db --server-url http://127.0.0.1:8000 --served-name policy --gate-tasks held_out.jsonl --gate-agent my_pkg.agents:solve
    """
    from .. import _api
    from ..trainer_bridge.promote import promote as judge_and_publish
    from ..trainer_bridge.runner import load_agent
    from .train import read_tasks

    tasks, agent = read_tasks(gate_path), load_agent(gate_agent)
    with open_store(store) as opened:
        _api.configure(store=opened)  # the gate agent's spans go to the store the gate reads
        result = judge_and_publish(opened, adapter, server_url=server_url, served_name=served_name, gate_agent=agent,
                                   gate_tasks=tasks, gate_n=gate_n, margin=gate_margin, confidence=gate_confidence)
    click.echo(json.dumps(result))
    if result["decision"] != "promoted":
        raise SystemExit(3)  # not a mistake (1) nor a usage error (2): the gate's answer
