"""``configure``, ``open_store``, ``stats``: the wiring between the tracer and the stores."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry.sdk.trace import SpanProcessor

from . import diagnostics
from .errors import ConfigurationError
from .settings import check_mode, check_redacted_tokens, load_redactor
from .store import Store
from .store import open_store as _open_store
from .store.uri import same_store
from .tracer.provider import RefusedRedaction, add_span_processors, tracing
from .sink import SpanSink

_UNSET: Any = object()


def open_store(url: str | os.PathLike[str] | None = None, *, read_only: bool = False) -> Store:
    """Open a store: ``sqlite:///runs.db``, a plain path, or ``memory://`` (default: LIGHTNING_RL_STORE
    or ``./lightning_rl.db``). ``read_only=True`` changes nothing in it (no migration, no spill replay)."""
    return _open_store(url, read_only=read_only)


def configure(
    *,
    store: str | os.PathLike[str] | Store | SpanSink | None = _UNSET,
    mode: str | None = None,
    policy_version: int | None = None,
    capture_token_ids: bool | None = None,
    capture_logprobs: bool | None = None,
    span_processors: Sequence[SpanProcessor] = (),
    redact: Callable[[str], str] | str | None = None,
    redacted_tokens: str | None = None,
) -> Store | SpanSink:
    """Set where rollouts go and how they are captured; returns the store in use.

    ``store``: a URL/path, a Store, or any object implementing ``SpanSink`` (``lightning_rl/sink.py``) (default: ``LIGHTNING_RL_STORE`` or ``./lightning_rl.db``).
    A URL naming the store already in use keeps it: calling ``configure`` again (a verl agent loop per
    sample, a runner per task) opens nothing new.
    ``span_processors``: the user's own OTel processors (e.g. an exporter) that also get our spans.
    ``redact``: ``fn(text) -> text`` (or its ``"module:function"``) applied to every text recorded (task,
    messages, tool arguments and results, errors) before anything gets it: the store, a spill file, the
    user's span processors; names and ids stay (``docs/privacy.md``; default: ``LIGHTNING_RL_REDACT``).
    ``redacted_tokens``: ``"drop"`` (default) or ``"keep"`` the token ids of an LLM call whose text
    redaction changed: kept, they decode to the original text; dropped, the call is not trained on.
    """
    settings = tracing.settings
    # redaction first, checked before anything else changes. A bad one fails closed: asked for and not set
    # up, it leaves every traced call refusing to start (as a bad LIGHTNING_RL_REDACT does) until a redaction
    # that works is configured, so code that catches the error and goes on records no unredacted text.
    tokens = check_redacted_tokens(redacted_tokens) if redacted_tokens is not None else settings.redacted_tokens
    try:
        if isinstance(redact, str):
            redact = load_redactor(redact, what="redact")
        if redact is not None and not callable(redact):
            raise ConfigurationError(f"redact={redact!r} is not a function; give fn(text: str) -> str or "
                                     "'module:function'")
    except ConfigurationError as exc:
        settings.redact = RefusedRedaction(ConfigurationError(
            f"{exc}; until configure(redact=...) is given one that works, traced calls refuse to start"))
        raise
    if redact is None:
        tracing.redaction(check=True)  # LIGHTNING_RL_REDACT: a bad module:function fails here, not at the first call
    else:
        settings.redact = redact
    settings.redacted_tokens = tokens
    if mode is not None:
        settings.mode = check_mode(mode)
    if capture_token_ids is not None:
        settings.capture_token_ids = bool(capture_token_ids)
    if capture_logprobs is not None:
        settings.capture_logprobs = bool(capture_logprobs)
    if policy_version is not None:
        tracing.set_policy_version(policy_version)
    add_span_processors(span_processors)
    if store is not _UNSET and store is not None:
        if isinstance(store, (Store, SpanSink)):
            tracing.set_sink(store)
        else:
            current = tracing.current_sink()
            url = getattr(current, "url", None)
            if not (url and same_store(url, store)):  # the same URL again keeps the open store
                tracing.set_sink(_open_store(store))
    return tracing.sink()


def set_policy_version(version: int, model: str | None = None) -> None:
    """Record that the served model (or ``model``) now runs policy ``version``; later spans carry it."""
    tracing.set_policy_version(version, model)


def flush(timeout: float | None = None) -> bool:
    """Wait until everything traced so far is in the store."""
    return tracing.sink().flush(timeout)


def stats() -> dict[str, int]:
    """Counters of everything that went wrong or waited (failures are never silent)."""
    return diagnostics.counters()


tracing.set_sink_factory(_open_store)


def command(argv: Sequence[str], **options: Any) -> Any:
    """An agent that is a command, in any language: ``lrl.command(["node", "agent.mjs"], upstream=URL)``
    returns a traced async ``agent(task)`` whose process calls the model through an in-process gateway
    (``lightning_rl.gateway.command`` says what the process gets and how its reward is read)."""
    from .gateway import command as _command  # late: the gateway needs FastAPI (the server extra)

    return _command(argv, **options)
