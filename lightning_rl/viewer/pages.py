"""HTML of the viewer's pages: plain server-rendered HTML with inline CSS and SVG, no script and no
build step, so a page needs nothing from the network. Every value shown is escaped here."""

from __future__ import annotations

import html
import json
import math
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from ..boundaries import safe_text

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:8px 16px;display:flex;gap:18px;align-items:center}
header a{color:#cfe0ff;text-decoration:none} header b{margin-right:12px}
main{padding:12px 16px} h1{font-size:18px;margin:6px 0 10px} h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;background:#fff;width:100%} th,td{border-bottom:1px solid #e3e6eb;padding:4px 6px;
text-align:left;vertical-align:top} th a{color:inherit} td.num{text-align:right;font-variant-numeric:tabular-nums}
form.filters{display:flex;flex-wrap:wrap;gap:8px;margin-bottom:10px;align-items:end}
form.filters label{display:flex;flex-direction:column;font-size:12px;color:#555}
input,select{font:inherit;padding:2px 4px} .pager{margin:8px 0;display:flex;gap:12px}
.status-succeeded{color:#17803d} .status-failed,.status-timed_out{color:#b42318} .status-running{color:#a15c00}
.meta{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px;background:#fff;padding:8px;max-width:900px}
.chat{max-width:900px} .bubble{border-radius:8px;padding:6px 10px;margin:6px 0;white-space:pre-wrap;
word-break:break-word} .role{font-size:11px;color:#666;text-transform:uppercase;letter-spacing:.04em}
.system{background:#eceff3} .user{background:#fff;border:1px solid #d6dbe3} .assistant{background:#e7f0ff;margin-left:40px}
.tool{background:#fff6e5;border:1px dashed #d9a441} .toolcall{font-family:ui-monospace,monospace;font-size:12px;
background:#fff;border:1px solid #c9d6ee;border-radius:4px;padding:3px 6px;margin-top:4px}
.tokens{background:#fff;padding:8px;line-height:1.9;font-family:ui-monospace,monospace;font-size:12px;max-width:1100px}
.tok{padding:1px 0;border-radius:2px;white-space:pre-wrap} .tok.masked{background:repeating-linear-gradient(45deg,
#e9e9e9,#e9e9e9 3px,#f7f7f7 3px,#f7f7f7 6px);color:#777} .tok.prompt{color:#888}
.legend span{display:inline-block;padding:0 6px;margin-right:6px;border-radius:2px}
.late{color:#a15c00;font-weight:600} .err{color:#b42318;white-space:pre-wrap}
.timeline{background:#fff;padding:8px;max-width:1100px} .bar{position:relative;height:18px;margin:2px 0}
.bar span{position:absolute;height:16px;border-radius:3px;font-size:11px;padding-left:3px;overflow:hidden;
white-space:nowrap;color:#10213f} .op-chat,.op-text_completion{background:#9cc0ff} .op-execute_tool{background:#ffd58a}
.op-invoke_agent{background:#c7d8c2} .op-other{background:#ddd}
.charts{display:flex;flex-wrap:wrap;gap:14px} .chart{background:#fff;padding:6px} .chart h3{font-size:13px;margin:0 0 4px}
.groups td{max-width:420px}
"""


def e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def page(title: str, body: str) -> str:
    nav = "".join(f'<a href="{href}">{label}</a>' for href, label in
                  (("/", "Rollouts"), ("/training", "Training")))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)} · lightning-rl</title>"
            f"<style>{STYLE}</style></head><body><header><b>lightning-rl</b>{nav}</header>"
            f"<main>{body}</main></body></html>")


def when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{digits}g}" if math.isfinite(value) else str(value)
    return str(value)


def short(value: Any, n: int = 120) -> str:
    try:
        text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    except (RecursionError, ValueError):  # a task nested deeper than JSON goes (a file of another version)
        text = safe_text(value)
    return text if len(text) <= n else text[:n - 1] + "…"


def link(path: str, params: Mapping[str, Any]) -> str:
    kept = {k: v for k, v in params.items() if v not in (None, "")}
    return path + ("?" + urllib.parse.urlencode(kept) if kept else "")


# -- the list ----------------------------------------------------------------------------------------
COLUMNS = (("rollout_id", "Rollout"), ("start_time", "Started"), ("status", "Status"), ("mode", "Mode"),
           ("agent", "Agent"), ("policy_version", "Policy"), ("reward", "Reward"), (None, "Task"), (None, "Group"))


def rollouts_page(result: Any, params: Mapping[str, Any], elapsed_ms: float) -> str:
    def select(name: str, options: Sequence[str]) -> str:
        chosen = params.get(name) or ""
        opts = "".join(f"<option value='{e(o)}'{' selected' if o == chosen else ''}>{e(o) or 'any'}</option>"
                       for o in ("", *options))
        return f"<label>{name}<select name='{name}'>{opts}</select></label>"

    def field(name: str, label: str, size: int = 8) -> str:
        return f"<label>{label}<input name='{name}' size='{size}' value='{e(params.get(name))}'></label>"

    form = ("<form class='filters' method='get' action='/'>"
            + select("mode", ("train", "eval", "prod"))
            + select("status", ("queued", "running", "succeeded", "failed", "timed_out"))
            + field("agent", "agent", 10) + field("policy_version", "policy version", 4)
            + field("reward_min", "reward ≥", 5) + field("reward_max", "reward ≤", 5)
            + field("text", "text in task or id", 22)
            + f"<input type='hidden' name='sort' value='{e(params.get('sort', 'start_time'))}'>"
            + f"<input type='hidden' name='order' value='{e(params.get('order', 'desc'))}'>"
            + "<button type='submit'>Filter</button></form>")
    sort, order = params.get("sort", "start_time"), params.get("order", "desc")
    head = ""
    for key, label in COLUMNS:
        if key is None:
            head += f"<th>{label}</th>"
            continue
        flip = "asc" if (key == sort and order == "desc") else "desc"
        arrow = (" ▼" if order == "desc" else " ▲") if key == sort else ""
        head += f"<th><a data-sort='{key}' href='{e(link('/', {**params, 'sort': key, 'order': flip, 'page': 1}))}'>{label}{arrow}</a></th>"
    rows = []
    for row in result.rows:
        r = row.rollout
        rows.append(
            f"<tr data-rollout='{e(r.rollout_id)}'><td><a href='{e('/rollouts/' + urllib.parse.quote(r.rollout_id, safe=''))}'>"
            f"{e(r.rollout_id[:12])}</a></td><td>{e(when(r.start_time))}</td>"
            f"<td class='status-{e(r.status.value)}'>{e(r.status.value)}</td><td>{e(r.mode.value)}</td>"
            f"<td>{e(r.agent)}</td><td class='num'>{e(r.policy_version)}</td>"
            f"<td class='num reward'>{e(fmt(row.reward))}</td><td>{e(short(r.task))}</td>"
            f"<td>{group_link(r.group_id)}</td></tr>")
    n = int(params.get("page") or 1)
    per = int(params.get("per_page") or 50)
    first = (n - 1) * per + 1 if result.total else 0
    pager = (f"<div class='pager'><span id='count'>{first}-{min(n * per, result.total)} of {result.total}</span>"
             + (f"<a href='{e(link('/', {**params, 'page': n - 1}))}'>← newer</a>" if n > 1 else "")
             + (f"<a id='next' href='{e(link('/', {**params, 'page': n + 1}))}'>older →</a>" if n * per < result.total else "")
             + f"<span style='color:#888'>{elapsed_ms:.0f} ms</span></div>")
    table = f"<table id='rollouts'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    return page("Rollouts", f"<h1>Rollouts</h1>{form}{pager}{table}{pager}")


def group_link(group_id: str | None) -> str:
    if not group_id:
        return ""
    return f"<a href='{e('/groups/' + urllib.parse.quote(group_id, safe=''))}'>{e(group_id[:10])}</a>"


# -- one rollout -------------------------------------------------------------------------------------
def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else short(value, 2000)


def _bubble(message: Mapping[str, Any]) -> str:
    role = str(message.get("role") or "message")
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(_text(p.get("text")) if isinstance(p, dict) else _text(p) for p in content)
    elif not isinstance(content, str):
        content = _text(content)
    listed = message.get("tool_calls")
    functions = [(tc.get("function") if isinstance(tc.get("function"), dict) else {}, tc)
                 for tc in (listed if isinstance(listed, list) else ()) if isinstance(tc, dict)]
    calls = "".join(
        f"<div class='toolcall'>→ {e(_text(fn.get('name')))}({e(_text(fn.get('arguments')))}) "
        f"<span style='color:#888'>{e(_text(tc.get('id')))}</span></div>" for fn, tc in functions)
    extra = f" <span style='color:#888'>{e(message.get('tool_call_id'))}</span>" if message.get("tool_call_id") else ""
    css = role if role in ("system", "user", "assistant", "tool") else "user"
    return (f"<div class='bubble {css}' data-role='{e(role)}'><div class='role'>{e(role)}{extra}</div>"
            f"{e(content)}{calls}</div>")


def conversation(calls: Sequence[Any]) -> str:
    """The messages in order: each call's new input messages, then its answer."""
    out, seen = [], 0
    for call in calls:
        fresh = call.input_messages[seen:] if seen <= len(call.input_messages) else call.input_messages
        for m in fresh:
            out.append(_bubble(m))
        for m in call.output_messages:
            out.append(_bubble(m))
        seen = len(call.input_messages) + len(call.output_messages)
    return "<div class='chat'>" + "".join(out) + "</div>"


def _lp_colour(lp: float | None) -> str:
    """Green for a confident token, through yellow, to red for an unlikely one (log-prob -4 and below)."""
    if lp is None:
        return "#eef"
    p = min(1.0, max(0.0, 1.0 + lp / 4.0))
    return f"hsl({int(p * 120)},75%,82%)"


def token_spans(ids: Sequence[int], text: Sequence[str] | None, logprobs: Sequence[float] | None,
                mask: Sequence[int] | None = None, css: str = "") -> str:
    out = []
    for i, tid in enumerate(ids):
        shown = text[i] if text is not None else f"[{tid}]"
        lp = logprobs[i] if logprobs is not None and i < len(logprobs) else None
        masked = mask is not None and i < len(mask) and not mask[i]
        cls = "tok " + ("masked" if masked else css)
        style = "" if masked or css == "prompt" else f" style='background:{_lp_colour(lp)}'"
        title = f"id {tid}" + ("" if lp is None or masked else f" · log-prob {lp:.3f}") + (" · masked (not trained)" if masked else "")
        out.append(f"<span class='{cls.strip()}'{style} title='{e(title)}'>{e(shown)}</span>")
    return "".join(out)


LEGEND = ("<div class='legend'>log-prob: " + "".join(
    f"<span style='background:{_lp_colour(lp)}'>{lp}</span>" for lp in (0, -1, -2, -3, -4))
    + "<span class='tok masked'>masked: tool or observation tokens, not trained</span></div>")


def timeline(spans: Sequence[Any]) -> str:
    if not spans:
        return "<p>No spans.</p>"
    start = min(s.start_ns for s in spans)
    end = max(max(s.end_ns, s.start_ns) for s in spans)
    width = max(1, end - start)
    depth: dict[str, int] = {}
    rows = []
    for s in sorted(spans, key=lambda s: (s.start_ns, s.seq)):
        d = depth.get(s.parent_id, -1) + 1 if s.parent_id in depth else 0
        depth[s.span_id] = d
        op = str(s.attributes.get("gen_ai.operation.name") or "other")
        css = op if op in ("chat", "text_completion", "execute_tool", "invoke_agent") else "other"
        left = (s.start_ns - start) / width * 100
        span_width = max(0.4, (max(s.end_ns, s.start_ns) - s.start_ns) / width * 100)
        ms = (s.end_ns - s.start_ns) / 1e6
        rows.append(f"<div class='bar' title='{e(s.name)} · {ms:.1f} ms'><span class='op-{css}' style='left:{left:.2f}%;"
                    f"width:{span_width:.2f}%;margin-left:{d * 6}px'>{e(s.name)} · {ms:.1f} ms</span></div>")
    return f"<div class='timeline'>{''.join(rows)}</div>"


def _shared_prefix(prompt: Sequence[int], earlier: Sequence[tuple[int, list[int]]]) -> tuple[int | None, int]:
    """The earlier call whose prompt + answer ``prompt`` starts with the most of (at least 16 tokens), and how many."""
    best_index, best = None, 0
    for index, full in earlier:
        n = min(len(prompt), len(full))
        if prompt[:n] != full[:n]:
            lo, hi = 0, n - 1  # the first lo match; the first hi+1 do not all match
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if prompt[:mid] == full[:mid] else (lo, mid - 1)
            n = lo
        if n > best:
            best_index, best = index, n
    return (best_index, best) if best >= 16 else (None, 0)


def rollout_page(rollout: Any, trajectory: Any, rewards: Sequence[Any], spans: Sequence[Any], samples: Sequence[Any],
                 decode: Any) -> str:
    r = rollout
    meta = [("Rollout", r.rollout_id), ("Name", r.name), ("Agent", r.agent), ("Status", r.status.value),
            ("Mode", r.mode.value), ("Policy version", r.policy_version), ("Attempt", r.attempt),
            ("Started", when(r.start_time)), ("Ended", when(r.end_time)), ("Task", short(r.task, 2000))]
    rows = "".join(f"<div><b>{k}</b></div><div{' class=status-' + e(v) if k == 'Status' else ''}>{e(v)}</div>"
                   for k, v in meta)
    rows += f"<div><b>Group</b></div><div>{group_link(r.group_id)}</div>"
    if r.error:
        rows += f"<div><b>Error</b></div><div class='err' id='error'>{e(r.error)}</div>"
    reward_rows = "".join(
        f"<tr><td>{e(w.name)}</td><td class='num'>{e(fmt(w.value))}</td><td>{e(w.source.value)}</td>"
        f"<td>{e(w.llm_call_index)}</td><td>{e(when(w.time))}"
        + (" <span class='late'>late</span>" if r.end_time is not None and w.time > r.end_time else "") + "</td></tr>"
        for w in rewards)
    reward_table = (f"<table id='rewards'><tr><th>Name</th><th>Value</th><th>Source</th><th>On call</th><th>Time</th></tr>"
                    f"{reward_rows}</table>" if rewards else "<p id='rewards'>No rewards yet.</p>")
    calls = []
    earlier: list[tuple[int, list[int]]] = []  # (index, prompt + response) of the last calls shown
    for c in trajectory.llm_calls:
        prompt = c.prompt_token_ids
        base, shared = _shared_prefix(prompt, earlier)
        tail = prompt[shared:]  # a long rollout's page grows with its length, not its length squared
        seen = f"; the first {shared} are call {base}'s prompt and answer, shown there" if shared else ""
        calls.append(
            f"<h3>Call {c.index} · {e(c.agent_name or '')} · {e(c.model)} · version {e(c.policy_version)} · "
            f"{len(prompt)} prompt + {len(c.response_token_ids)} response tokens · ids from "
            f"{e(c.token_ids_source.value)}</h3><div class='tokens call-tokens'>"
            f"<details><summary>prompt ({len(prompt)} tokens{e(seen)})</summary>"
            f"{token_spans(tail, decode(tail), None, css='prompt')}</details>"
            f"{token_spans(c.response_token_ids, decode(c.response_token_ids), c.response_logprobs)}</div>")
        earlier = [*earlier[-7:], (c.index, prompt + c.response_token_ids)]
    sample_html = []
    for s in samples:
        sample_html.append(
            f"<h3>Trained sample · reward {e(fmt(s.reward))} · {sum(s.response_mask)} of {len(s.response_ids)} "
            f"response tokens trained</h3><div class='tokens sample-tokens'>"
            f"{token_spans(s.response_ids, decode(s.response_ids), s.rollout_logprobs, s.response_mask)}</div>")
    body = (f"<h1>Rollout {e(r.rollout_id[:12])}</h1><div class='meta'>{rows}</div>"
            f"<h2>Rewards</h2>{reward_table}<h2>Conversation</h2>{conversation(trajectory.llm_calls)}"
            f"<h2>Tokens</h2>{LEGEND}{''.join(sample_html)}{''.join(calls) or '<p>No LLM calls.</p>'}"
            f"<h2>Spans</h2>{timeline(spans)}")
    return page(f"Rollout {r.rollout_id[:12]}", body)


# -- a group ---------------------------------------------------------------------------------------
def group_page(group_id: str, rows: Sequence[tuple[Any, float | None, float | None, str]], how: str) -> str:
    cells = "".join(
        f"<tr data-rollout='{e(t.rollout_id)}'><td class='num'>{e(t.attempt)}</td>"
        f"<td><a href='{e('/rollouts/' + urllib.parse.quote(t.rollout_id, safe=''))}'>{e(t.rollout_id[:12])}</a></td>"
        f"<td class='status-{e(t.status.value)}'>{e(t.status.value)}</td><td>{e(t.mode.value)}</td>"
        f"<td class='num reward'>{e(fmt(reward))}</td><td class='num advantage'>{e(fmt(advantage))}</td>"
        f"<td>{e(short(answer, 400))}</td></tr>"
        for t, reward, advantage, answer in rows)
    task = short(rows[0][0].task, 2000) if rows else ""
    body = (f"<h1>Group {e(group_id)}</h1><p>Task: {e(task)}</p><p>{e(how)}</p>"
            f"<table class='groups' id='group'><tr><th>Try</th><th>Rollout</th><th>Status</th><th>Mode</th>"
            f"<th>Reward</th><th>Advantage</th><th>Answer</th></tr>{cells}</table>")
    return page(f"Group {group_id}", body)


# -- training --------------------------------------------------------------------------------------
def svg_chart(title: str, series: Mapping[str, Sequence[tuple[float, float]]], width: int = 420, height: int = 200) -> str:
    points = [p for s in series.values() for p in s]
    if not points:
        return ""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - 0.5, y1 + 0.5
    pad = 34
    colours = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (width - pad - 8)

    def sy(y: float) -> float:
        return height - 20 - (y - y0) / (y1 - y0) * (height - 30)

    lines, legend = [], []
    for i, (name, pts) in enumerate(series.items()):
        colour = colours[i % len(colours)]
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        lines.append(f"<polyline fill='none' stroke='{colour}' stroke-width='1.8' points='{path}'/>"
                     + "".join(f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='2.2' fill='{colour}'><title>{e(name)} "
                               f"step {fmt(x)}: {fmt(y, 4)}</title></circle>" for x, y in pts))
        legend.append(f"<tspan fill='{colour}'>■ {e(name)} </tspan>")
    axes = (f"<line x1='{pad}' y1='{height - 20}' x2='{width - 8}' y2='{height - 20}' stroke='#999'/>"
            f"<line x1='{pad}' y1='10' x2='{pad}' y2='{height - 20}' stroke='#999'/>"
            f"<text x='2' y='14' font-size='10'>{e(fmt(y1))}</text><text x='2' y='{height - 22}' font-size='10'>{e(fmt(y0))}</text>"
            f"<text x='{pad}' y='{height - 6}' font-size='10'>step {e(fmt(x0))}</text>"
            f"<text x='{width - 60}' y='{height - 6}' font-size='10'>{e(fmt(x1))}</text>")
    return (f"<div class='chart' data-metric='{e(title)}'><h3>{e(title)}</h3><svg width='{width}' height='{height + 14}'>"
            f"{axes}{''.join(lines)}<text x='{pad + 4}' y='{height + 10}' font-size='11'>{''.join(legend)}</text></svg></div>")


def _test_figures(figures: dict[str, Any]) -> tuple[Any, Any, Any]:
    """(candidate mean, live mean, bound) of the test a decision holds: the canary's, the gate's, or the
    watch's (its upper bound); blanks when it holds none."""
    for prefix, bound in (("canary_", "lower_bound"), ("gate_", "lower_bound"), ("watch_", "upper_bound")):
        if f"{prefix}mean_candidate" in figures:
            return (figures[f"{prefix}mean_candidate"], figures.get(f"{prefix}mean_live"),
                    figures.get(f"{prefix}{bound}"))
    return None, None, None


def decisions_table(decisions: Sequence[Any]) -> str:
    """The policy decisions in the store (the gate's, the canary's, rollbacks), newest first."""
    if not decisions:
        return ""
    rows = "".join(
        f"<tr><td>{e(time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(d.time)))}</td><td>{e(d.served_name)}</td>"
        f"<td class='num'>{e(d.version)}</td><td>{e(d.decision.value)}</td><td class='num'>{e(d.live_version)}</td>"
        f"<td class='num'>{e(fmt(cand, 4))} / {e(fmt(live, 4))}</td><td class='num'>{e(fmt(bound, 4))}</td>"
        f"<td>{e(d.reason or '')}</td></tr>"
        for d in decisions for cand, live, bound in [_test_figures(d.figures)])
    return ("<h2>Policy decisions</h2><table id='decisions'><tr><th>Time (UTC)</th><th>Served name</th><th>Version</th>"
            "<th>Decision</th><th>Live</th><th>Mean reward (candidate / live)</th><th>Bound</th><th>Reason</th></tr>"
            f"{rows}</table>")


def training_page(runs: Sequence[str], chosen: str | None, charts: Sequence[str], note: str,
                  decisions: Sequence[Any] = ()) -> str:
    options = "".join(f"<li><a href='{e(link('/training', {'run': r}))}'>{'<b>' if r == chosen else ''}"
                      f"{e(r)}{'</b>' if r == chosen else ''}</a></li>" for r in runs)
    body = (f"<h1>Training</h1><p>{e(note)}</p><ul id='runs'>{options}</ul>"
            f"<div class='charts'>{''.join(charts) or '<p>No metrics to draw.</p>'}</div>{decisions_table(decisions)}")
    return page("Training", body)
