"""What every command module shares: the one-line error for user mistakes, opening a store, times."""

from __future__ import annotations

import datetime as dt
import functools
from typing import Any

import click

from ..errors import ConfigurationError, LightningRLError, missing_dependency

STORE_HELP = "Store URL or path (default: $LIGHTNING_RL_STORE or ./lightning_rl.db)."


def errors(fn):
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


def open_store(store: str | None, *, read_only: bool = False):
    from .._api import open_store as _open_store

    return _open_store(store, read_only=read_only)


def when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "-"


def policy_map(policies: tuple[str, ...]) -> dict[str, str]:
    """``--policy AGENT=SERVED`` options as Trainer's policies= mapping."""
    team = {}
    for item in policies:
        name, sep, served = item.partition("=")
        if not sep or not name or not served:
            raise ConfigurationError(f"--policy {item!r} is not AGENT=SERVED (e.g. --policy planner=planner-lora)")
        team[name] = served
    return team


def gate_test_options(fn):
    """The gate's test (``noninferiority.not_worse``), where a command judges a candidate: tries, margin, confidence."""
    fn = click.option("--gate-confidence", type=float, default=0.9, show_default=True,
                      help="Confidence of the one-sided lower bound on the reward difference.")(fn)
    fn = click.option("--gate-margin", type=float, default=0.1, show_default=True,
                      help="Mean reward a candidate may lose and still go live.")(fn)
    return click.option("--gate-n", type=int, default=1, show_default=True, help="Tries per gate task and policy.")(fn)
