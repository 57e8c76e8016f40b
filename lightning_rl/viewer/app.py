"""``lightning-rl view``: a read-only web UI over any store, and the training curves of its runs.

Pages (HTML from ``pages.py``; no script, nothing from the network):

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

import hashlib
import hmac
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..boundaries import INT64_MAX, header_secret, secret_matches
from ..errors import ConfigurationError, LightningRLError, RolloutNotFoundError
from ..records import RolloutQuery
from ..serving import VIEWER, BackgroundService, check_bind, run
from ..store.queries import trajectory as assemble_trajectory
from ..store.training_samples import trajectory_samples
from ..trainer_bridge.loggers import staleness_mean
from . import pages

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
except ImportError as exc:  # like the store server and the gateway
    raise ConfigurationError(
        f"the viewer needs FastAPI and uvicorn ({exc}); they come with lightning-rl: pip install fastapi uvicorn httptools (or reinstall lightning-rl)"
    ) from None

COOKIE = "lrl_view_token"
MAX_RUNS = 200
#: Sent with every answer: nothing from elsewhere, no script, no framing, no content sniffing.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}


def session_value(token: str) -> str:
    """What the session cookie holds: an HMAC of the token, so the cookie never carries the token."""
    return hmac.new(token.encode("utf-8", "surrogatepass"), b"lightning-rl viewer session", hashlib.sha256).hexdigest()


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


def _query(params: dict[str, str]) -> tuple[RolloutQuery, int, int]:
    """The list's query from its URL; a bad value is a 400 that names it."""
    def number(name: str, kind: type) -> Any:
        raw = params.get(name)
        if raw in (None, ""):
            return None
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{name} must be a {kind.__name__}, got {raw!r}") from None

    page, per_page = number("page", int) or 1, number("per_page", int) or 50
    if not 1 <= page <= INT64_MAX // 500 or not 1 <= per_page <= 500:
        raise ValueError(f"page must be 1..{INT64_MAX // 500} and per_page 1..500, got {page}, {per_page}")
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be asc or desc, got {order!r}")
    query = RolloutQuery(
        mode=params.get("mode") or None, status=params.get("status") or None, agent=params.get("agent") or None,
        group_id=params.get("group_id") or None, policy_version=number("policy_version", int),
        reward_min=number("reward_min", float), reward_max=number("reward_max", float),
        text=params.get("text") or None, sort=params.get("sort") or "start_time", descending=order == "desc",
        offset=(page - 1) * per_page, limit=per_page)
    return query, page, per_page


def _metric_runs(metrics_dir: Path | None) -> dict[str, Path]:
    if metrics_dir is None or not metrics_dir.is_dir():
        return {}
    found = sorted(metrics_dir.rglob("metrics.jsonl"))[:MAX_RUNS]
    return {str(p.parent.relative_to(metrics_dir)) or ".": p for p in found}


CURVES = (  # (chart title, metrics-line key), one curve per policy where a team logs per policy
    ("reward (train)", "train_reward"), ("success (held out)", "eval_success"), ("loss", "loss"),
    ("clip fraction", "pg_clipfrac"), ("staleness (mean versions behind)", "staleness"),
    ("engine/trainer log-prob gap", "engine_logprob_gap"), ("reward (policy's samples)", "reward_mean"),
    ("gate: lower bound of the reward difference", "gate_lower_bound"),
    ("gate: promoted (1) or refused (0)", "gate_promoted"),
)
MAX_DECISIONS = 50  # the newest policy decisions the training page lists


def _value(line: dict[str, Any], key: str) -> float | None:
    value = line.get(key)
    if key == "staleness" and isinstance(value, dict):
        return staleness_mean(value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def training_charts(path: Path) -> list[str]:
    lines = []
    for raw in path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            continue  # a line being written
    charts = []
    for title, key in CURVES:
        series: dict[str, list[tuple[float, float]]] = {}
        for line in lines:
            step = line.get("step", line.get("version"))
            if not isinstance(step, (int, float)):
                continue
            policies = line.get("policies")
            if isinstance(policies, dict) and key not in ("train_reward", "eval_success", "staleness"):
                for name, numbers in policies.items():
                    if isinstance(numbers, dict) and (v := _value(numbers, key)) is not None:
                        series.setdefault(name, []).append((step, v))
            elif (v := _value(line, key)) is not None:
                series.setdefault("policy" if key not in ("train_reward", "eval_success") else key, []).append((step, v))
        if series:
            charts.append(pages.svg_chart(title, series))
    return charts


def create_app(store: Any, *, metrics_dir: str | Path | None = None, tokenizer: str | Path | None = None,
               token: str | None = None) -> Any:
    metrics = Path(metrics_dir) if metrics_dir is not None else None
    decode = token_decoder(tokenizer)
    app = FastAPI(title="lightning-rl viewer", docs_url=None, redoc_url=None, openapi_url=None)

    session = session_value(token) if token is not None else None

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        response = await _authorized(request, call_next)
        response.headers.update(SECURITY_HEADERS)
        return response

    async def _authorized(request: Request, call_next: Any) -> Any:
        if token is None:
            return await call_next(request)
        scheme, _, bearer = (request.headers.get("authorization") or "").partition(" ")
        bearer = bearer.strip() if scheme.lower() == "bearer" and bearer.strip() else None
        query = request.query_params.get("token")
        cookie = request.cookies.get(COOKIE)
        if bearer is not None:
            ok = secret_matches(header_secret(bearer), token)
        elif query is not None:
            ok = secret_matches(query, token)
        else:
            ok = cookie is not None and secret_matches(cookie, session)
        if not ok:
            given = bearer or query or cookie
            return JSONResponse({"error": f"{'missing' if not given else 'wrong'} token: open the viewer with "
                                          "?token=<token> (the --token it was started with)"}, status_code=401)
        if query is not None:  # the token leaves the URL (history, links, Referer); a session cookie stays
            kept = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + ("?" + urllib.parse.urlencode(kept) if kept else "")
            response = RedirectResponse(target, status_code=303)
            response.set_cookie(COOKIE, session, httponly=True, samesite="strict")
            return response
        return await call_next(request)

    @app.get("/", response_class=HTMLResponse)
    def rollouts(request: Request) -> Response:
        params = dict(request.query_params)
        try:
            query, page, per_page = _query(params)
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            return HTMLResponse(pages.page("Bad query", f"<h1>Bad query</h1><p class='err'>{pages.e(exc)}</p>"), 422)
        started = time.perf_counter()
        result = store.rollout_page(query)
        elapsed = (time.perf_counter() - started) * 1000
        params.update(page=str(page), per_page=str(per_page))
        return HTMLResponse(pages.rollouts_page(result, params, elapsed))

    @app.get("/rollouts/{rollout_id}", response_class=HTMLResponse)
    def rollout(rollout_id: str, request: Request) -> Response:
        try:
            record = store.get_rollout(rollout_id)
        except RolloutNotFoundError as exc:
            return HTMLResponse(pages.page("Not found", f"<h1>Not found</h1><p class='err'>{pages.e(exc)}</p>"), 404)
        trajectory = assemble_trajectory(store, rollout_id)
        samples, _ = trajectory_samples(trajectory, level="trajectory")
        return HTMLResponse(pages.rollout_page(record, trajectory, store.rewards(rollout_id), store.spans(rollout_id),
                                               samples, decode))

    @app.get("/groups/{group_id}", response_class=HTMLResponse)
    def group(group_id: str, request: Request) -> Response:
        found = store.rollout_page(group_id=group_id, sort="rollout_id", descending=False, limit=1000).rows
        trajectories = sorted((assemble_trajectory(store, row.rollout.rollout_id) for row in found), key=lambda t: t.attempt)
        if not trajectories:
            return HTMLResponse(pages.page("Not found", f"<h1>No rollouts in group {pages.e(group_id)}</h1>"), 404)
        rewards = [t.final_reward for t in trajectories]
        try:
            advantages, how = _grpo(rewards), GRPO_HOW
        except ImportError:  # the viewer is in the server extra; the trainer's function needs torch
            advantages, how = [None] * len(rewards), GRPO_NEEDS_TORCH
        rows = [(t, r, a, t.llm_calls[-1].response_text if t.llm_calls else "")
                for t, r, a in zip(trajectories, rewards, advantages)]
        return HTMLResponse(pages.group_page(group_id, rows, how))

    @app.get("/training", response_class=HTMLResponse)
    def training(request: Request, run: str | None = None) -> Response:
        runs = _metric_runs(metrics)
        if metrics is None:
            note = "Start the viewer with --metrics DIR (a training run's output folder) to see its curves."
        elif not runs:
            note = f"No metrics.jsonl under {metrics}."
        else:
            note = f"Runs under {metrics}:"
        chosen = run if run in runs else (next(iter(runs)) if runs else None)
        charts = training_charts(runs[chosen]) if chosen else []
        try:
            decisions = store.decisions()[-MAX_DECISIONS:][::-1]
        except LightningRLError:  # a store server from before decisions were recorded
            decisions = []
        return HTMLResponse(pages.training_page(list(runs), chosen, charts, note, decisions))

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "store": store.url}

    return app


GRPO_HOW = ("Advantage: GRPO's, by the local trainer's own function: (reward - the group's mean) / (its std + "
            "1e-6), over the tries that have a reward; a try with none has none.")
GRPO_NEEDS_TORCH = ("GRPO advantages are computed by the local trainer's own function, which needs torch: "
                    "pip install 'lightning-rl[local]'")


def _grpo(rewards: Sequence[float | None]) -> list[float | None]:
    """The local trainer's GRPO advantage of each try with a reward (``algorithms.grpo_outcome_advantage``)."""
    have = [i for i, r in enumerate(rewards) if r is not None]
    out: list[float | None] = [None] * len(rewards)
    if not have:
        return out
    import numpy as np
    import torch

    from ..trainer_bridge.algorithms import grpo_outcome_advantage

    scores = torch.tensor([[float(rewards[i])] for i in have])
    advantages, _ = grpo_outcome_advantage(scores, torch.ones_like(scores), np.zeros(len(have), dtype=np.int64))
    for i, value in zip(have, advantages[:, 0].tolist()):
        out[i] = value
    return out


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
