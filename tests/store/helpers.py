"""Builders for records written straight into a store (no tracer), for store-level tests."""

from __future__ import annotations

import orjson

from lightning_rl import semconv
from lightning_rl.records import Rollout, Span, SpanTokens


def llm_span(rollout_id: str, seq: int, index: int, prompt: list[int], response: list[int], *,
             agent: str | None = None, logprobs: list[float] | None = None, source: str = "engine",
             policy_version: int = 0, model: str = "tiny") -> Span:
    attrs = {
        semconv.GEN_AI_OPERATION_NAME: "chat",
        semconv.GEN_AI_REQUEST_MODEL: model,
        semconv.LLM_CALL_INDEX: index,
        semconv.POLICY_VERSION: policy_version,
        semconv.TOKEN_IDS_SOURCE: source,
        semconv.GEN_AI_INPUT_MESSAGES: orjson.dumps([{"role": "user", "content": f"turn {index}"}]).decode(),
        semconv.GEN_AI_OUTPUT_MESSAGES: orjson.dumps([{"role": "assistant", "content": f"answer {index}"}]).decode(),
    }
    tokens = None
    if source == "engine":
        tokens = SpanTokens(prompt_ids=prompt, response_ids=response,
                            response_logprobs=logprobs if logprobs is not None else [-0.5] * len(response))
    if agent:
        attrs[semconv.GEN_AI_AGENT_NAME] = agent
    return Span(rollout_id=rollout_id, seq=seq, trace_id="%032x" % 1, span_id="%016x" % (seq + 1),
                parent_id="%016x" % 1 if seq else None, name="chat tiny", kind="CLIENT",
                start_ns=1000 - seq, end_ns=2000 - seq, attributes=attrs, tokens=tokens)  # clocks deliberately backwards


def rollout(rollout_id: str, **kw) -> Rollout:
    return Rollout(rollout_id=rollout_id, name="agent", agent="agent", task={"q": rollout_id}, **kw)


def old_schema_store(path, version: int, attributes: list[dict]) -> None:
    """A store as an older lightning-rl wrote it (schema ``version``): rollout ``old`` of one LLM span per
    entry of ``attributes``, stored whole in the attributes' JSON (before packed tokens and shared text)."""
    import sqlite3

    import sqlite_utils

    from lightning_rl.store.sqlite import migrations

    conn = sqlite3.connect(path, isolation_level=None)
    db = sqlite_utils.Database(conn)
    for v in range(1, version + 1):
        migrations.MIGRATIONS.get(v)(db)
    conn.execute(f"PRAGMA application_id = {migrations.APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.execute("INSERT INTO rollouts (rollout_id, name, attempt, mode, status, start_time) "
                 "VALUES ('old', 'agent', 0, 'train', 'succeeded', 1.0)")
    for seq, attrs in enumerate(attributes):
        conn.execute("INSERT INTO spans (rollout_id, seq, trace_id, span_id, name, kind, start_ns, end_ns, status_code, "
                     "attributes) VALUES ('old', ?, ?, ?, 'chat tiny', 'CLIENT', 1, 2, 'OK', ?)",
                     (seq, "%032x" % 1, "%016x" % (seq + 1), orjson.dumps(attrs).decode()))
    conn.close()


def store_with_a_lost_base(path, spans: list[Span]) -> None:
    """A store file holding rollout ``r1`` of ``spans``, then damaged: the span of seq 1 (the base the
    span of seq 2 refers to) deleted by hand."""
    import sqlite3

    from lightning_rl.store.sqlite.store import SQLiteStore

    with SQLiteStore(path) as store:
        store.start_rollout(rollout("r1"))
        store.add_spans(spans)
        store.flush()
    conn = sqlite3.connect(path)
    conn.execute("DELETE FROM spans WHERE seq = 1")
    conn.commit()
    conn.close()
