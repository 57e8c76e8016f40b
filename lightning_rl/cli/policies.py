"""``lightning-rl policies``: the served names' policies in a store (``policies rollback``)."""

from __future__ import annotations

import json

import click

from ..settings import ENV_BASE_URL
from ._common import STORE_HELP, errors, open_store


@click.group("policies")
def policies() -> None:
    """The policies a store records for each served name: roll one back.

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
