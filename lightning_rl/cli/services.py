"""Long-running services and their store: ``store serve|doctor|migrate|prune|openapi``, ``gateway``, ``view``,
``runner``."""

from __future__ import annotations

import json
import sys

import click

from ..settings import ENV_GATEWAY_TOKEN, ENV_STORE_TOKEN, ENV_STORE_TOKENS_FILE, ENV_VIEW_TOKEN
from ._common import STORE_HELP, errors, open_store, when

@click.group("store")
def store_group() -> None:
    """Serve a store over HTTP for many runner processes and machines; inspect, upgrade and prune a store."""


@store_group.command("serve")
@click.option("--db", default="lightning_rl.db", show_default=True,
              help="The store to serve: a SQLite file, or postgresql://USER@HOST:PORT/DATABASE[?schema=NAME].")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs --token or --tokens.")
@click.option("--port", type=int, default=8765, show_default=True)
@click.option("--token", envvar=ENV_STORE_TOKEN, default=None,
              help="The admin bearer token (default: $LIGHTNING_RL_STORE_TOKEN).")
@click.option("--tokens", "tokens_file", envvar=ENV_STORE_TOKENS_FILE, default=None,
              type=click.Path(dir_okay=False),
              help="File of tokens with roles, one 'ROLES TOKEN' a line (lightning-rl store token prints them), "
                   "re-read when it changes (default: $LIGHTNING_RL_STORE_TOKENS_FILE).")
@click.option("--max-body-mb", type=float, default=64, show_default=True, help="Largest request body accepted.")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Server processes on the port (they parse in parallel and share the store).")
@click.option("--synchronous", type=click.Choice(["full", "normal"]), default=None,
              help="SQLite only. full (the default): an acknowledged batch survives a power loss (an fsync per "
                   "commit); normal: a killed server.")
@click.option("--log-level", default="warning", show_default=True)
@errors
def store_serve(db: str, host: str, port: int, token: str | None, tokens_file: str | None, max_body_mb: float,
                workers: int, synchronous: str | None, log_level: str) -> None:
    """Serve a store over HTTP; clients set LIGHTNING_RL_STORE=http://HOST:PORT.

    Over PostgreSQL the server is stateless: start any number, on any machines, over one database, and give
    clients all their URLs (LIGHTNING_RL_STORE=http://a:8765,http://b:8765: a client moves to the next
    when one fails) or put them behind a load balancer. See docs/fleet.md.

    Example: lightning-rl store serve --db runs.db --host 0.0.0.0 --port 8765 --token $TOKEN

    Example: lightning-rl store serve --db postgresql://lrl@db.internal:5432/lrl --host 0.0.0.0 --token $TOKEN

    Example: lightning-rl store serve --db runs.db --host 0.0.0.0 --tokens /etc/lightning-rl/tokens
    """
    from ..serving import STORE_SERVER, check_bind
    from ..store.http.server import serve
    from ..store.uri import store_backend

    check_bind(STORE_SERVER, host, token or tokens_file)
    backend = store_backend(db)
    if not backend.servable:
        raise click.ClickException(f"--db {db!r:.200} is not a SQLite file or a postgresql:// URL; a store server "
                                   "serves one of those (e.g. --db runs.db, --db postgresql://lrl@db:5432/lrl)")
    if "synchronous" not in backend.options and synchronous is not None:
        raise click.ClickException("--synchronous is SQLite's; a PostgreSQL store is as durable as the database "
                                   "makes it (its synchronous_commit setting): leave --synchronous out")
    serve(db, host=host, port=port, token=token, max_body_bytes=int(max_body_mb * 2**20), log_level=log_level,
          workers=workers, synchronous=synchronous, tokens_file=tokens_file, announce=lambda: click.echo(
              f"serving {shown_url(db)} on http://{host}:{port} (OpenAPI at /openapi.json)", err=True))


def shown_url(store: object) -> str:
    """A store (or its URL) as messages show it: no password."""
    from ..store.uri import redacted

    if isinstance(store, str):
        return redacted(store)
    return getattr(store, "shown", None) or redacted(store.url)  # type: ignore[attr-defined]


@store_group.command("doctor")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Quarantined records shown.")
@click.option("--json", "as_json", is_flag=True, help="The report as one JSON object.")
@errors
def store_doctor(store: str | None, limit: int, as_json: bool) -> None:
    """What a store holds that needs attention: records set aside in its quarantine (with the reason and
    the original record), spill files not yet written back, and this process's failure counters. Exits 1
    when something is there. Opens the store read-only: it writes nothing and replays nothing.

    Example: lightning-rl store doctor --store runs.db
    """
    from .. import diagnostics

    opened = open_store(store, read_only=True)
    try:
        quarantine = opened.quarantined(limit=limit)
        total = len(opened.quarantined(limit=2**62)) if len(quarantine) >= limit else len(quarantine)
        spills = [str(p) for p in getattr(opened, "spill_files", [])]
        rejected = [str(p) for p in getattr(opened, "rejected_files", [])]  # a store server's client only
        report = {"store": shown_url(opened), "quarantined": total, "spill_files": len(spills),
                  "quarantine": [q.model_dump(mode="json", exclude={"schema_version"}) for q in quarantine],
                  "spill": spills, "rejected_files": rejected, "counters": diagnostics.counters()}
    finally:
        opened.close()
    if as_json:
        click.echo(json.dumps(report))
    else:
        if total:
            click.echo(f"{total} record(s) quarantined in {report['store']} (they could not be written; the rest "
                       "of their batches was). Newest first:")
            for q in quarantine:
                click.echo(f"  #{q.quarantine_id} {when(q.time)} {q.kind} rollout={q.rollout_id or '-'}: {q.reason}")
                click.echo(f"      record: {q.payload[:300]}")
        else:
            click.echo(f"nothing quarantined in {report['store']}")
        if spills:
            click.echo(f"{len(spills)} spill file(s) not yet written back (the next process that opens the store "
                       f"for writing replays them): {', '.join(spills[:5])}")
        if rejected:
            click.echo(f"{len(rejected)} file(s) of records the store server refused (kept, never replayed; the "
                       f"first line of each says why): {', '.join(rejected[:5])}")
    if total or spills or rejected:
        sys.exit(1)


@store_group.command("migrate")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--vacuum", is_flag=True, help="SQLite only: then rewrite the file to give back the space it no longer "
              "uses (SQLite's VACUUM: needs as much free disk as the file, and no other process writing meanwhile).")
@errors
def store_migrate(store: str | None, vacuum: bool) -> None:
    """Upgrade a store written by an older lightning-rl to this version's schema, in place: a SQLite file, or
    the tables of a PostgreSQL store (its schema, one transaction; safe while servers run: they wait). Any
    command that opens a store for writing does the same, so this says what happened, from which schema.
    A lightning-rl older than the schema can no longer open it afterwards.

    Example: lightning-rl store migrate --store runs.db --vacuum

    Example: lightning-rl store migrate --store postgresql://lrl@db.internal:5432/lrl
    """
    import sqlite3
    from pathlib import Path

    from ..store.sqlite.store import SQLiteStore
    from ..store.uri import store_backend

    backend = store_backend(store)
    if vacuum and "vacuum" not in backend.options:  # before anything is opened: a refused option changes nothing
        raise click.ClickException("--vacuum is SQLite's; PostgreSQL gives space back by its autovacuum (or by "
                                   "VACUUM FULL, which its administrator runs: it locks the store's tables)")
    opened = open_store(store)
    opened.close()
    from ..store.kit.backends import DEFAULT, backend_named

    latest = (backend.schema_version or backend_named(DEFAULT).schema_version)()
    before = getattr(opened, "schema_found", None)
    where = shown_url(opened)
    if before == 0:
        click.echo(f"{where}: a new store, created with schema {latest}")
    elif before and before < latest:
        click.echo(f"{where}: upgraded from schema {before} to {latest}")
    else:
        click.echo(f"{where}: schema {latest}, up to date")
    if vacuum and isinstance(opened, SQLiteStore):
        size = Path(opened.path).stat().st_size
        conn = sqlite3.connect(opened.path)
        try:
            conn.execute("VACUUM")
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            conn.close()
        click.echo(f"{where}: vacuumed, {size:,} -> {Path(opened.path).stat().st_size:,} bytes")


@store_group.command("prune")
@click.option("--older-than", "older_than", required=True,
              help="Erase rollouts that ended this long ago or earlier (one that never ended: that started so): a "
                   "number and s, m, h, d or w, e.g. 30d.")
@click.option("--mode", default=None, help="Only rollouts of this mode (train, eval, prod).")
@click.option("--keep-trained", is_flag=True,
              help="Keep rollouts whose group a published policy was trained on (its trained_on lineage).")
@click.option("--dry-run", is_flag=True, help="Say what would be erased; erase nothing.")
@click.option("--full", is_flag=True, help="Then rebuild the files: SQLite VACUUM (the file shrinks; no other process "
              "may write meanwhile), PostgreSQL VACUUM FULL (locks the tables while it runs).")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--json", "as_json", is_flag=True, help="The result as one JSON object.")
@errors
def store_prune(older_than: str, mode: str | None, keep_trained: bool, dry_run: bool, full: bool, store: str | None,
                as_json: bool) -> None:
    """Erase old rollouts with their spans, rewards, queue entries and the text they hold (docs/retention.md):
    SQLite zeroes what it frees and empties its WAL; PostgreSQL vacuums (--full: VACUUM FULL, which is what
    takes the bytes out of its table files). Policy records and their lineage stay.

    Example: lightning-rl store prune --older-than 30d --mode prod --keep-trained --store runs.db --dry-run
    """
    from pathlib import Path

    from ..store.erasure import parse_duration, prune
    from ..store.sqlite.store import SQLiteStore

    seconds = parse_duration(older_than)
    opened = open_store(store)
    try:
        where = shown_url(opened)
        files = [Path(opened.path + s) for s in ("", "-wal")] if isinstance(opened, SQLiteStore) else []
        size_before = sum(p.stat().st_size for p in files if p.exists())
        result = prune(opened, seconds, mode=mode, keep_trained=keep_trained, dry_run=dry_run, full=full)
        size_after = sum(p.stat().st_size for p in files if p.exists())
    finally:
        opened.close()
    report = {"store": where, "dry_run": dry_run, "cutoff": result.cutoff, "rollouts": len(result.rollout_ids),
              "spans": result.spans, "rewards": result.rewards, "deleted": result.deleted,
              "kept_trained": result.kept_trained}
    if files:
        report.update(bytes_before=size_before, bytes_after=size_after)
    if as_json:
        click.echo(json.dumps(report))
        return
    which = f"{'' if mode is None else mode + ' '}rollouts that ended before {when(result.cutoff)}"
    if dry_run:
        click.echo(f"{where}: would erase {len(result.rollout_ids)} {which} ({result.spans} spans, {result.rewards} "
                   "rewards); nothing was erased (--dry-run)")
        for rollout_id in result.rollout_ids[:20]:
            click.echo(f"  {rollout_id}")
        if len(result.rollout_ids) > 20:
            click.echo(f"  ... and {len(result.rollout_ids) - 20} more")
    else:
        click.echo(f"{where}: erased {result.deleted} {which}, {result.spans} spans, {result.rewards} rewards")
    if keep_trained:
        click.echo(f"kept {result.kept_trained} old rollout(s) a published policy was trained on (--keep-trained)")
    if files:
        click.echo(f"file size: {size_before:,} -> {size_after:,} bytes (the database and its WAL)"
                   + ("" if full or dry_run else "; freed pages are zeroed and reused, --full gives them back"))


@store_group.command("openapi")
def store_openapi() -> None:
    """Print the store server's OpenAPI document (JSON).

    Example: lightning-rl store openapi > store-openapi.json
    """
    from ..store.http.server import openapi_schema

    click.echo(openapi_schema())


@store_group.command("token")
@click.option("--role", "roles", multiple=True, required=True,
              help="runner (write rollouts, lease and complete tries), reader (read-only: view, export) or admin "
                   "(everything: erase, publish, decide, enqueue); repeat for several. docs/fleet.md lists which "
                   "command needs which.")
@click.option("--json", "as_json", is_flag=True, help="The token and the line as one JSON object.")
@errors
def store_token(roles: tuple[str, ...], as_json: bool) -> None:
    """Mint a token for a store server: the token (give it to the client, as LIGHTNING_RL_STORE_TOKEN) and the
    line to append to the server's tokens file (--tokens; it holds only the token's SHA-256). The server
    reads the file again within a second of a change: no restart; delete the line to revoke the token.

    Example: lightning-rl store token --role runner >> /etc/lightning-rl/tokens  (the line goes to the file; the
    token, on stderr, to your terminal)

    Example: lightning-rl store token --role runner --json
    """
    from ..store.http.auth import mint_token

    minted = mint_token(list(roles))
    if as_json:
        click.echo(json.dumps({"roles": list(minted.roles), "token": minted.token, "line": minted.line}))
        return
    click.echo(f"# token (give it to the client as {ENV_STORE_TOKEN}; shown once, not kept anywhere):", err=True)
    click.echo(f"#   {minted.token}", err=True)
    click.echo(f"# append the next line to the server's tokens file ({ENV_STORE_TOKENS_FILE} or --tokens):", err=True)
    click.echo(minted.line)


@click.command("gateway")
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
@click.option("--redact", default=None, metavar="MODULE:FUNCTION",
              help="A function of one str returning a str, applied to every text before it is stored, e.g. "
                   "mypkg.privacy:scrub (default: $LIGHTNING_RL_REDACT; see docs/privacy.md).")
@click.option("--redacted-tokens", type=click.Choice(["drop", "keep"]), default=None,
              help="Token ids of a call whose text was redacted: drop them (not trained on) or keep them (they "
                   "decode to the original text) (default: $LIGHTNING_RL_REDACTED_TOKENS or drop).")
@click.option("--shared", is_flag=True, default=False,
              help="Several gateways behind one plain balancer: keep each open rollout's state in the store, so "
                   "that any of them serves its next call (needs --token, the same on each; docs/fleet.md).")
@click.option("--model", default=None, metavar="NAME",
              help="Send every call to the engine as this served model, whatever name the agent asks for (coding "
                   "CLIs ask for their vendor's models: Claude Code's claude-*); the name asked is kept on the call.")
@click.option("--log-level", default="warning", show_default=True)
@errors
def gateway(upstreams: tuple[str, ...], store: str | None, host: str, port: int, token: str | None,
            idle_timeout: float, redact: str | None, redacted_tokens: str | None, shared: bool,
            model: str | None, log_level: str) -> None:
    """Trace agents in any language: an OpenAI-compatible proxy that records rollouts into the store.

    Open a rollout with POST /v1/rollouts; point the agent's OpenAI client at the base_url (or use the
    api_key) it answers with; end it with POST /v1/rollouts/{id}/finish.

    Example: lightning-rl gateway --upstream http://127.0.0.1:8000 --store runs.db --port 8400

    Two behind a balancer: lightning-rl gateway --shared --token "$T" --store http://store:8765 --upstream ...
    """
    from .. import _api
    from ..gateway import Gateway, serve
    from ..serving import GATEWAY, check_bind
    from ..settings import load_redactor

    check_bind(GATEWAY, host, token)
    if redact is not None or redacted_tokens is not None:  # a bad module:function stops it here, before serving
        # loaded first: a bad one ends the command, leaving no refused redaction in this process's set-up
        function = load_redactor(redact, what="--redact") if redact is not None else None
        _api.configure(redact=function, redacted_tokens=redacted_tokens)
    proxy = Gateway(list(upstreams), token=token, idle_timeout=idle_timeout or None, shared=shared, model=model)  # bad upstreams are refused before the store is opened
    opened = open_store(store)
    if shared:  # every call reads the rollout back: a store token without the reader role fails here, not per call
        from ..errors import RolloutNotFoundError

        try:
            opened.llm_call_counts(["lightning-rl-gateway-start-check"])
        except RolloutNotFoundError:
            pass
    _api.configure(store=opened)
    serve(proxy, host=host, port=port, log_level=log_level, announce=lambda: click.echo(
        f"gateway on http://{host}:{port} in front of {', '.join(proxy.upstreams)}"
        + (" (shared: rollouts kept in the store)" if shared else ""), err=True))


@click.command("view")
@click.option("--store", default=None, help=STORE_HELP)
@click.option("--metrics", "metrics_dir", default=None, type=click.Path(file_okay=False),
              help="A folder with training runs' metrics.jsonl (searched below it) for the Training page.")
@click.option("--tokenizer", default=None, type=click.Path(file_okay=False),
              help="The served model's directory, to show token text (default: token ids).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Anything but loopback needs --token.")
@click.option("--port", type=int, default=8500, show_default=True)
@click.option("--token", envvar=ENV_VIEW_TOKEN, default=None,
              help="Required beyond loopback; open the viewer with ?token=... (default: $LIGHTNING_RL_VIEW_TOKEN).")
@errors
def view(store: str | None, metrics_dir: str | None, tokenizer: str | None, host: str, port: int,
         token: str | None) -> None:
    """A read-only web UI over a store: rollouts, conversations, tokens, rewards, groups, training curves.

    Example: lightning-rl view --store runs.db --metrics .cache/demo-rl --tokenizer .cache/tiny-qwen2
    """
    from ..serving import VIEWER, check_bind
    from ..viewer.app import serve

    check_bind(VIEWER, host, token)
    opened = open_store(store, read_only=True)  # the viewer never writes: no migration, no spill replay
    serve(opened, host=host, port=port, metrics_dir=metrics_dir, tokenizer=tokenizer, token=token,
          announce=lambda: click.echo(f"viewer on http://{host}:{port} over {shown_url(opened)} (read-only)", err=True))


@click.command("runner")
@click.option("--agent", required=True, help="module:function of the traced agent to run on leased tasks.")
@click.option("--store", default=None, help=STORE_HELP + " Usually http://HOST:PORT of a store server; several, "
              "comma-separated, to move to the next when one fails.")
@click.option("--concurrency", type=int, default=8, show_default=True, help="Tries run at once.")
@click.option("--lease-seconds", type=float, default=60.0, show_default=True,
              help="A try not heartbeaten for this long is given to another runner.")
@click.option("--rollout-timeout", type=float, default=120.0, show_default=True)
@click.option("--runner-id", default=None, help="Name in the queue (default: runner-PID-random).")
@click.option("--idle-exit", type=float, default=None, help="Exit after this many seconds with nothing to do.")
@click.option("--max-rollouts", type=int, default=None, help="Exit after running this many tries.")
@click.option("--report", type=click.Path(dir_okay=False), default=None,
              help="Write a JSON report at exit (tries run, store write latencies).")
@click.option("--wait", "lease_wait", type=click.FloatRange(0, 300), default=5.0, show_default=True,
              help="Longest one lease request waits in the store for a try (a long poll: a queued try is taken at "
                   "once, an idle runner asks once per WAIT seconds); at most a quarter of --lease-seconds, and over "
                   "a store server at most its client's read timeout less 2 s (8 s by default); 0: ask every --poll "
                   "seconds.")
@click.option("--poll", type=click.FloatRange(0.001, 60), default=0.05, show_default=True,
              help="Pause between lease requests that did not wait (--wait 0, or a store that answers at once).")
@errors
def runner(agent, store, concurrency, lease_seconds, rollout_timeout, runner_id, idle_exit, max_rollouts,
           report, lease_wait, poll) -> None:
    """Run tries of the store's task queue with a traced agent, until stopped.

    Example: LIGHTNING_RL_STORE=http://10.0.0.5:8765 lightning-rl runner --agent my_pkg.agents:solve
    """
    import signal

    from .._api import configure, stats
    from ..trainer_bridge.agent_loading import load_agent
    from ..trainer_bridge.runner import Runner

    opened = configure(store=store) if store else configure()
    worker = Runner(opened, load_agent(agent), runner_id=runner_id, concurrency=concurrency,
                    lease_seconds=lease_seconds, rollout_timeout=rollout_timeout, wait=lease_wait, poll=poll)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    click.echo(f"{worker.runner_id}: running {agent} on tasks from {shown_url(opened)}", err=True)
    with worker:
        ran = worker.serve(idle_exit=idle_exit, max_rollouts=max_rollouts)
    opened.flush()
    click.echo(f"{worker.runner_id}: ran {ran} tries", err=True)
    if report:
        latencies = list(getattr(opened, "latencies", []))
        with open(report, "w") as f:
            json.dump({"runner": worker.runner_id, "ran": ran, "write_latencies_s": latencies,
                       "counters": stats()}, f)
