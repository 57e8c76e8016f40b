"""``lightning-rl policies``: the served names' policies in a store (``policies rollback``, ``policies promote``,
``policies sync``). ``--server-url`` takes one vLLM server or a replica set (a comma list, or the option
repeated: ``trainer_bridge/replicas.py``)."""

from __future__ import annotations

import json

import click

from ..settings import ENV_BASE_URL, ENV_GATEWAY_TOKEN
from ._common import STORE_HELP, errors, gate_test_options, open_store


@click.group("policies")
def policies() -> None:
    """The policies a store records for each served name: promote a candidate through the gate, roll one back.

    Example: lightning-rl policies rollback --to 3 --store runs.db --server-url http://127.0.0.1:8000
    """


@policies.command("rollback")
@click.option("--to", "version", type=int, required=True, help="The version to make live again.")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--server-url", envvar=ENV_BASE_URL, required=True, multiple=True,
              help=f"The vLLM server that serves the policy; replicas: repeat it or give a comma list (default: "
              f"${ENV_BASE_URL}).")
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
        record = roll_back(opened, to=version, server_url=list(server_url), served_name=served_name, reason=reason)
    click.echo(json.dumps({"served_name": record.served_name, "version": record.version, "adapter": record.adapter}))


@policies.command("promote")
@click.option("--adapter", required=True, type=click.Path(exists=True, file_okay=False),
              help="The candidate LoRA folder (e.g. export-model --verl-checkpoint's adapter/).")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--server-url", envvar=ENV_BASE_URL, required=True, multiple=True,
              help=f"The vLLM server that serves the policy, with --enable-lora --max-loras 2; replicas: repeat it "
              f"or give a comma list (default: ${ENV_BASE_URL}).")
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
    from ..trainer_bridge.agent_loading import load_agent
    from .train import read_tasks

    tasks, agent = read_tasks(gate_path), load_agent(gate_agent)
    with open_store(store) as opened:
        _api.configure(store=opened)  # the gate agent's spans go to the store the gate reads
        result = judge_and_publish(opened, adapter, server_url=list(server_url), served_name=served_name,
                                   gate_agent=agent,
                                   gate_tasks=tasks, gate_n=gate_n, margin=gate_margin, confidence=gate_confidence)
    click.echo(json.dumps(result))
    if result["decision"] != "promoted":
        raise SystemExit(3)  # not a mistake (1) nor a usage error (2): the gate's answer


@policies.command("sync")
@click.option("--replica", "replicas", multiple=True,
              help="A vLLM server of the replica set (repeat it, or give a comma list).")
@click.option("--gateway", default=None, help="Or: the replicas a lightning-rl gateway routes to (its /v1/upstreams).")
@click.option("--gateway-token", envvar=ENV_GATEWAY_TOKEN, default=None,
              help=f"The gateway's token, for --gateway (default: ${ENV_GATEWAY_TOKEN}).")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--served-name", default="policy", show_default=True, help="The LoRA name agents call.")
@click.option("--watch", type=click.FloatRange(min=0.1), default=None, metavar="SECONDS",
              help="Reconcile again every SECONDS until interrupted (a replica that restarts gets the live version).")
@errors
def sync(replicas, gateway, gateway_token, store, served_name, watch) -> None:
    """Load the live version of a served name on every replica that lacks it (a replica that restarted).

    Reads each replica's /v1/models and loads the store's latest publish (its versioned name and the stable
    one) where missing. Prints what was loaded as JSON, one line per pass.

    Example: lightning-rl policies sync --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000 --store runs.db --watch 5
    """
    import time

    from ..errors import PublishError
    from ..trainer_bridge.replicas import from_gateway
    from ..trainer_bridge.replicas import sync as sync_replicas

    if bool(replicas) == bool(gateway):
        raise click.UsageError("give the replicas with --replica URL (repeated, or a comma list), or --gateway URL")
    if gateway:
        replicas = from_gateway(gateway, token=gateway_token)
    with open_store(store, read_only=True) as opened:
        while True:
            try:
                click.echo(json.dumps(sync_replicas(opened, list(replicas), served_name)))
            except PublishError as exc:
                if watch is None:
                    raise
                click.echo(f"Error: {exc}", err=True)  # a replica down now: tried again at the next pass
            if watch is None:
                return
            time.sleep(watch)
