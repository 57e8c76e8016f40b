"""``lightning-rl view``: a read-only web UI over any store, and the training curves of its runs.

Pages (their routes in ``routes.py``, HTML from ``pages.py``; no script, nothing from the network):

* ``/``: rollouts, filtered (mode, status, agent, policy version, reward range, text in the task or
  id), sorted by any column, paged: one ``Store.rollout_page`` query (SQL on a SQLite store, one
  request to a store server), so it stays fast on a large store (docs/benchmarks.md section 14).
* ``/rollouts/{id}``: the conversation as chat bubbles with tool calls and results; each LLM call's
  tokens coloured by log-prob; the trained sample with tool/observation tokens masked; rewards with
  source, name and time (late feedback marked late); the span tree as a timeline; status and error.
* ``/groups/{id}``: a task's tries side by side with their rewards and GRPO advantages, computed by the
  local trainer's own function (``trainer_bridge.algorithms.grpo_outcome_advantage``).
* ``/training``: reward, success, loss, clip fraction, staleness and the engine/trainer log-prob gap
  against step, one curve per policy, from the ``metrics.jsonl`` files under ``--metrics``.

Token text comes from ``--tokenizer`` (a Hugging Face model directory); without one, token ids are
shown. Auth: the store server's rule. Bound beyond loopback it needs ``--token``; a request then
carries it as ``Authorization: Bearer``, or opens ``?token=...`` once: the answer is a redirect to the
same page without it that sets a session cookie holding an HMAC of the token (never the token itself).

The viewer never writes: ``lightning-rl view`` opens the store read-only (no migration, no spill file
adopted or replayed). Every page is sent with a Content-Security-Policy that allows nothing but its
own inline style, ``nosniff`` and ``X-Frame-Options: DENY``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigurationError
from ..serving import VIEWER, BackgroundService, check_bind, run

try:
    from fastapi import FastAPI
except ImportError as exc:  # like the store server and the gateway
    raise ConfigurationError(
        f"the viewer needs FastAPI and uvicorn ({exc}); they come with lightning-rl: pip install fastapi uvicorn httptools (or reinstall lightning-rl)"
    ) from None
from .routes import COOKIE, SECURITY_HEADERS, Viewer, add_routes, session_value, training_charts


def token_decoder(tokenizer_dir: str | Path | None) -> Callable[[Sequence[int]], list[str] | None]:
    """ids -> each token's text (cached per id), or None without a tokenizer (ids are shown)."""
    if tokenizer_dir is None:
        return lambda ids: None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigurationError("--tokenizer needs transformers: pip install 'lightning-rl[local]' (or leave "
                                 "--tokenizer out to see token ids)") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as exc:
        raise ConfigurationError(f"--tokenizer {str(tokenizer_dir)!r} could not be loaded ({type(exc).__name__}: "
                                 f"{exc}); give the served model's directory, or leave it out to see token ids") from None
    cache: dict[int, str] = {}

    def decode(ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            text = cache.get(i)
            if text is None:
                text = cache[i] = tokenizer.decode([i])
            out.append(text)
        return out

    return decode


def create_app(store: Any, *, metrics_dir: str | Path | None = None, tokenizer: str | Path | None = None,
               token: str | None = None) -> Any:
    """The viewer's ASGI app over ``store``: the pages and the token guard of ``routes.py``."""
    viewer = Viewer(store, Path(metrics_dir) if metrics_dir is not None else None, token_decoder(tokenizer), token,
                    session_value(token) if token is not None else None)
    app = FastAPI(title="lightning-rl viewer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.viewer = viewer
    add_routes(app)
    return app


def serve(store: Any, *, host: str = "127.0.0.1", port: int = 8500, metrics_dir: str | Path | None = None,
          tokenizer: str | Path | None = None, token: str | None = None, log_level: str = "warning",
          announce: Callable[[], None] | None = None) -> None:
    check_bind(VIEWER, host, token)  # before the app is built
    run(VIEWER, create_app(store, metrics_dir=metrics_dir, tokenizer=tokenizer, token=token), host=host, port=port,
        token=token, log_level=log_level, announce=announce)


class BackgroundViewer(BackgroundService):
    """The viewer on a thread of this process (tests, notebooks). Port 0 picks a free port."""

    def __init__(self, store: Any, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 **options: Any) -> None:
        check_bind(VIEWER, host, token)  # before the app is built
        super().__init__(VIEWER, create_app(store, token=token, **options), host=host, port=port, token=token)


__all__ = ["COOKIE", "SECURITY_HEADERS", "BackgroundViewer", "create_app", "serve", "session_value", "token_decoder",
           "training_charts"]
