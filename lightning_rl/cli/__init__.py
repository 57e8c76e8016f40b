"""The ``lightning-rl`` command: a thin layer over the Python API (one public call per command).

The commands, by module: ``rollouts.py`` (``rollouts ls|show|expire``), ``data.py`` (``export``, ``sft``,
``judge``, ``export-model``, ``plot``), ``train.py`` (``train run|continuous|replay|verl``), ``policies.py``
(``policies rollback``), ``services.py``
(``store serve|doctor|migrate|openapi``, ``gateway``, ``view``, ``runner``). Every command has an example
in its ``--help`` and exits 1 with a one-line error on a user's mistake (``_common.errors``).
"""

from __future__ import annotations

import click

from .data import export, export_model, judge, plot, sft
from .policies import policies
from .rollouts import rollouts
from .sandbox import sandbox_group
from .services import gateway, runner, store_group, view
from .train import train


@click.group()
@click.version_option(package_name="lightning-rl")
def main() -> None:
    """Trace agents, store their rollouts, export training samples, train.

    Example: lightning-rl rollouts ls --store sqlite:///runs.db
    """


for _command in (rollouts, export, sft, judge, export_model, train, policies, store_group, gateway, view, runner, plot,
                 sandbox_group):
    main.add_command(_command)
del _command

__all__ = ["main"]
