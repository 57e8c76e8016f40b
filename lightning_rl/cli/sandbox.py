"""``lightning-rl sandbox``: run one command in a fresh sandbox exactly as a try's would (``exec``), and say which
backends work on this machine (``doctor``)."""

from __future__ import annotations

import sys

import click

from ..errors import ConfigurationError, SandboxError
from ..settings import ENV_GATEWAY_URL
from ._common import errors

#: Exit codes of ``sandbox exec`` that are not the command's (as timeout(1) and docker run use them).
EXIT_DEADLINE = 124
EXIT_SANDBOX = 125


@click.group("sandbox")
def sandbox_group() -> None:
    """Sandboxes for a try's commands (docs/sandboxes.md).

    Example: lightning-rl sandbox exec --dir tasks/fix-parser -- python3 -m pytest -q
    """


@sandbox_group.command("exec", context_settings={"ignore_unknown_options": True})
@click.option("--backend", default="bwrap", show_default=True, help="bwrap, docker or podman (make containers), or local (no isolation, for debugging).")
@click.option("--dir", "folder", default=None, type=click.Path(file_okay=False),
              help="The task folder: the sandbox gets its own copy (default: an empty folder).")
@click.option("--timeout", default=60.0, show_default=True, type=float, help="The command's deadline in seconds.")
@click.option("--memory", "memory_mb", default=2048, show_default=True, type=int, help="Address space limit, MB.")
@click.option("--network", default="none", show_default=True, type=click.Choice(["none", "gateway"]),
              help="none: its own empty network namespace; gateway: the gateway at --gateway-url is its only "
                   "address, at the same URL inside (bwrap).")
@click.option("--gateway-url", default=None, envvar=ENV_GATEWAY_URL,
              help="The gateway for --network gateway, http://HOST:PORT (default: $LIGHTNING_RL_GATEWAY_URL).")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@errors
def sandbox_exec(backend: str, folder: str | None, timeout: float, memory_mb: int, network: str,
                 gateway_url: str | None, argv: tuple[str, ...]) -> None:
    """Run ARGV in a fresh sandbox and exit with its exit code: 124 when the deadline ended it, 125 when the
    sandbox itself failed (it could not start), 128+N when signal N ended it. Its output is printed as it was
    kept (1 MiB of each stream; what was cut is said on stderr).

    Example: lightning-rl sandbox exec --dir tasks/fix-parser --timeout 120 -- python3 -m pytest -q
    """
    from ..sandbox import Limits, open_sandbox

    options = {}
    if network == "gateway":
        if not gateway_url:
            raise ConfigurationError("--network gateway needs the gateway's address: give --gateway-url "
                                     "http://HOST:PORT (or set LIGHTNING_RL_GATEWAY_URL)")
        if backend != "bwrap":
            raise ConfigurationError(f"--network gateway is built for the bwrap backend, not {backend!r}; "
                                     "use --backend bwrap")
        options["gateway"] = gateway_url
    try:
        with open_sandbox(backend, folder, limits=Limits(memory_mb=memory_mb), **options) as box:
            done = box.run(list(argv), timeout=timeout)
    except SandboxError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(EXIT_SANDBOX)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.truncated_bytes:
        click.echo(f"(sandbox: {done.truncated_bytes} bytes of output past the 1 MiB a stream keeps were cut)", err=True)
    if done.ended == "deadline":
        click.echo(f"(sandbox: the deadline of {timeout:g} s ended the command and everything it started)", err=True)
        sys.exit(EXIT_DEADLINE)
    sys.exit(done.exit_code if done.ended == "exit" else 128 + (done.signal or 0))


@sandbox_group.command("doctor")
def sandbox_doctor() -> None:
    """Say which sandbox backends work on this machine and, for each that does not, why and the fix; exits 1 when
    the default (bwrap) does not.

    Example: lightning-rl sandbox doctor
    """
    from ..sandbox import bwrap_available, overlay_available
    from ..sandbox.cgroups import cgroups_missing
    from ..sandbox.container import container_available

    missing = bwrap_available()
    click.echo("bwrap: works" if missing is None else f"bwrap: does not work: {missing}")
    overlay = overlay_available()
    click.echo("  copy-on-write snapshots: yes" if overlay is None else
               f"  copy-on-write snapshots: no, each try gets a full copy ({overlay})")
    groups = cgroups_missing()
    click.echo("  processes, memory and CPU held by control groups: yes" if groups is None else f"  {groups}")
    for cli in ("docker", "podman"):
        absent = container_available(cli)
        click.echo(f"{cli}: works" if absent is None else f"{cli}: does not work: {absent}")
    click.echo("local: works (no isolation: only by name, for debugging)")
    if missing is not None:
        sys.exit(1)
