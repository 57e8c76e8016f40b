"""The viewer's routes (``app.py`` assembles them): the token guard every answer passes, and the four pages
with what each reads from the store (the list's query from its URL, a group's GRPO advantages, the training
curves under ``--metrics``). The state of one viewer (its store, token, decoder) is a :class:`Viewer` on
``app.state.viewer``."""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from ..boundaries import INT64_MAX, header_secret, secret_matches
from ..errors import LightningRLError, RolloutNotFoundError
from ..records import RolloutQuery
from ..store.queries import trajectory as assemble_trajectory
from ..store.training_samples import trajectory_samples
from ..trainer_bridge.loggers import staleness_mean
from . import pages

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


@dataclass(slots=True)
class Viewer:
    """What one viewer app serves: ``store``, the runs under ``metrics``, token text by ``decode``; ``token``
    (None: no auth, loopback only) and ``session``, the cookie value that stands for it."""

    store: Any
    metrics: Path | None
    decode: Callable[[Sequence[int]], list[str] | None]
    token: str | None = None
    session: str | None = None


def viewer_of(request: Request) -> Viewer:
    return request.app.state.viewer


def add_routes(app: Any) -> None:
    """The guard and the pages, on ``app`` (whose ``state.viewer`` is a :class:`Viewer`)."""
    app.middleware("http")(guard)
    app.get("/", response_class=HTMLResponse)(rollouts)
    app.get("/rollouts/{rollout_id}", response_class=HTMLResponse)(rollout)
    app.get("/groups/{group_id}", response_class=HTMLResponse)(group)
    app.get("/training", response_class=HTMLResponse)(training)
    app.get("/health")(health)


async def guard(request: Request, call_next: Any) -> Any:
    """The ``http`` middleware: the token, then the security headers on every answer."""
    response = await _authorized(request, call_next)
    response.headers.update(SECURITY_HEADERS)
    return response


async def _authorized(request: Request, call_next: Any) -> Any:
    token, session = viewer_of(request).token, viewer_of(request).session
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


def rollouts(request: Request) -> Response:
    store = viewer_of(request).store
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


def rollout(rollout_id: str, request: Request) -> Response:
    store = viewer_of(request).store
    try:
        record = store.get_rollout(rollout_id)
    except RolloutNotFoundError as exc:
        return HTMLResponse(pages.page("Not found", f"<h1>Not found</h1><p class='err'>{pages.e(exc)}</p>"), 404)
    trajectory = assemble_trajectory(store, rollout_id)
    samples, _ = trajectory_samples(trajectory, level="trajectory")
    return HTMLResponse(pages.rollout_page(record, trajectory, store.rewards(rollout_id), store.spans(rollout_id),
                                           samples, viewer_of(request).decode))


def group(group_id: str, request: Request) -> Response:
    store = viewer_of(request).store
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


def training(request: Request, run: str | None = None) -> Response:
    viewer = viewer_of(request)
    metrics = viewer.metrics
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
        decisions = viewer.store.decisions()[-MAX_DECISIONS:][::-1]
    except LightningRLError:  # a store server from before decisions were recorded
        decisions = []
    return HTMLResponse(pages.training_page(list(runs), chosen, charts, note, decisions))


def health(request: Request) -> dict[str, Any]:
    return {"ok": True, "store": viewer_of(request).store.url}


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
