"""Redaction without a model server (issue 36): the rollout's task, tool arguments and results, errors and
tracebacks, through SQLite, the HTTP store (and its spill folder) and a user's span processor; a failing
function fails closed; LIGHTNING_RL_REDACT and its one-line errors. With the real vLLM server (token ids):
``test_redaction_vllm.py``; the gateway: ``tests/gateway/test_redact_vllm.py``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import lightning_rl as lrl
from lightning_rl import diagnostics, semconv
from lightning_rl.errors import ConfigurationError
from lightning_rl.store import SQLiteStore
from lightning_rl.tracer import tracing
from lightning_rl.tracer.redaction import FAILED, REDACTED

from .redactors import CANARY, SECRET, broken, not_a_str, scrub

ROOT = Path(__file__).resolve().parents[2]


def files_holding(folder: Path, needle: str) -> list[str]:
    """Every file under ``folder`` whose bytes hold ``needle`` (the .db, its -wal and -shm, spill files)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and needle.encode() in p.read_bytes())


@pytest.fixture
def redaction():
    """Restores the redaction settings after the test."""
    diagnostics.reset()
    s = tracing.settings
    saved = (s.redact, s.redact_spec, s.redacted_tokens)
    yield
    s.redact, s.redact_spec, s.redacted_tokens = saved


@pytest.fixture
def sqlite_in(tmp_path):
    folder = tmp_path / "store"
    folder.mkdir()
    store = SQLiteStore(folder / "runs.db")
    previous = tracing._sink
    yield folder, store
    tracing.set_sink(previous)
    store.close()


def agent_with_a_tool_that_fails():
    @lrl.trace(agent="billing")
    def agent(question: str) -> float:
        with lrl.tool_span("lookup_card", arguments={"card": SECRET, "note": CANARY}) as tool:
            tool.result = f"card {SECRET} belongs to {CANARY}"
        with lrl.tool_span("charge", arguments={"card": SECRET}):
            raise ValueError(f"card {SECRET} declined ({CANARY})")

    return agent


def test_task_tool_text_errors_and_tracebacks_never_reach_the_store_nor_a_span_processor(redaction, sqlite_in):
    folder, store = sqlite_in
    exporter = InMemorySpanExporter()
    lrl.configure(store=store, redact=scrub, span_processors=[SimpleSpanProcessor(exporter)])
    with pytest.raises(ValueError, match=SECRET):  # the agent's own exception is untouched
        agent_with_a_tool_that_fails()(f"charge {SECRET} for {CANARY}")
    store.flush()
    assert files_holding(folder, SECRET) == []
    assert files_holding(folder, CANARY) != []  # the text is there as bytes, redacted
    (rollout,) = store.rollouts()
    assert rollout.task == f"charge [card] for {CANARY}" and rollout.agent == "billing"
    assert rollout.error == f"ValueError: card [card] declined ({CANARY})"
    spans = {s.name: s for s in store.spans(rollout.rollout_id)}
    assert set(spans) == {"invoke_agent billing", "execute_tool lookup_card", "execute_tool charge"}  # names stay
    lookup = spans["execute_tool lookup_card"].attributes
    assert lookup[semconv.GEN_AI_TOOL_NAME] == "lookup_card" and lookup[semconv.GEN_AI_AGENT_NAME] == "billing"
    assert lookup[semconv.TOOL_ARGUMENTS] == f'{{"card":"[card]","note":"{CANARY}"}}'
    assert lookup[semconv.TOOL_RESULT] == f"card [card] belongs to {CANARY}" and lookup[REDACTED] is True
    charge = spans["execute_tool charge"]
    assert charge.status_message and "[card]" in charge.status_message
    (event,) = charge.events
    assert event["attributes"]["exception.type"] == "ValueError"
    assert "[card]" in event["attributes"]["exception.message"] and "[card]" in event["attributes"]["exception.stacktrace"]
    # the user's processor got the same redacted spans, events and status
    exported = exporter.get_finished_spans()
    assert len(exported) == 3 and all(SECRET not in s.to_json() for s in exported)
    assert any(f"[card] belongs to {CANARY}" in s.to_json() for s in exported)


def test_the_http_store_and_its_spill_folder_get_redacted_records(redaction, tmp_path):
    from lightning_rl.store.http.client import HttpStore
    from lightning_rl.store.http.server import BackgroundServer

    previous = tracing._sink
    with BackgroundServer(tmp_path / "served" / "served.db") as server:
        store = HttpStore(server.url, spill_dir=tmp_path / "spill", retry_for=5.0)
        try:
            lrl.configure(store=store, redact=scrub)
            with pytest.raises(ValueError):
                agent_with_a_tool_that_fails()(f"charge {SECRET} for {CANARY}")
            store.flush()
            server.close()
            with pytest.raises(ValueError):  # the server is gone: these records spill to disk, redacted
                agent_with_a_tool_that_fails()(f"again {SECRET} for {CANARY}")
        finally:
            tracing.set_sink(previous)
            store.close()
    assert files_holding(tmp_path, SECRET) == []
    assert files_holding(tmp_path / "served", CANARY) != [] and files_holding(tmp_path / "spill", CANARY) != []


@pytest.mark.parametrize("fn", [broken, not_a_str], ids=["raises", "returns-bytes"])
def test_a_failing_function_fails_closed_counted_and_logged_once(redaction, sqlite_in, fn, caplog):
    folder, store = sqlite_in
    lrl.configure(store=store, redact=fn)

    @lrl.trace
    def agent(question: str) -> float:
        with lrl.tool_span("lookup", arguments={"q": question}) as tool:
            tool.result = SECRET
        return 1.0

    with caplog.at_level(logging.WARNING, logger="lightning_rl"):
        assert agent(SECRET) == 1.0 and agent(SECRET) == 1.0  # the agent never sees the failure
    store.flush()
    assert files_holding(folder, SECRET) == []
    rollouts = store.rollouts()
    assert [r.task for r in rollouts] == [FAILED, FAILED] and {r.status for r in rollouts} == {"succeeded"}
    (tool,) = [s for s in store.spans(rollouts[0].rollout_id) if s.name == "execute_tool lookup"]
    assert tool.attributes[semconv.TOOL_RESULT] == FAILED and tool.attributes[semconv.GEN_AI_TOOL_NAME] == "lookup"
    assert lrl.stats()["redaction_failed"] == 6  # task, arguments, result; twice
    logged = [r for r in caplog.records if "redaction function" in r.getMessage()]
    assert len(logged) == 1 and "returns a str" in logged[0].getMessage()


@pytest.mark.parametrize("bad", ["tests.tracer.redactors:nope", "tests.tracer.redactors:CANARY", 123],
                         ids=["no-such-function", "not-callable", "not-a-function"])
def test_a_redaction_configure_refused_fails_closed_for_code_that_goes_on(redaction, sqlite_in, bad):
    """A user trial: a notebook that catches configure's error and runs its agent stored the secret
    unredacted in ./lightning_rl.db. Asked for and not set up, redaction now leaves traced calls refusing."""
    folder, store = sqlite_in
    lrl.configure(store=store)
    with pytest.raises(ConfigurationError, match="redact=") as refused:
        lrl.configure(redact=bad)
    assert "\n" not in str(refused.value)
    if isinstance(bad, str) and bad.endswith("CANARY"):
        assert "is a str, not a function" in str(refused.value)
    ran = []

    @lrl.trace
    def agent(question: str) -> None:
        ran.append(question)

    with pytest.raises(ConfigurationError, match="traced calls refuse to start"):
        agent(SECRET)
    with pytest.raises(ConfigurationError):  # configure without a redaction does not lift it
        lrl.configure(store=store)
    store.flush()
    assert ran == [] and store.rollouts() == [] and files_holding(folder, SECRET) == []
    lrl.configure(redact=scrub)  # one that works does
    agent(SECRET)
    store.flush()
    assert [r.task for r in store.rollouts()] == ["[card]"] and files_holding(folder, SECRET) == []


def test_a_failed_redaction_keeps_the_exception_type_in_the_rollout_error(redaction, sqlite_in):
    folder, store = sqlite_in
    lrl.configure(store=store, redact=broken)

    @lrl.trace
    def agent(question: str) -> None:
        raise KeyError(question)

    with pytest.raises(KeyError):
        agent(SECRET)
    store.flush()
    (rollout,) = store.rollouts()
    assert rollout.error == f"KeyError: {FAILED}" and files_holding(folder, SECRET) == []


def test_a_bad_module_function_fails_at_configure_and_at_the_rollout_start_not_later(redaction, sqlite_in):
    folder, store = sqlite_in
    with pytest.raises(ConfigurationError, match=r"redact='no_such_module_xyz:scrub'.*cannot be imported"):
        lrl.configure(store=store, redact="no_such_module_xyz:scrub")
    with pytest.raises(ConfigurationError, match=r"has no function 'nope'"):
        lrl.configure(redact="tests.tracer.redactors:nope")
    tracing.settings.redact, tracing.settings.redact_spec = None, "no_such_module_xyz:scrub"  # as from the variable
    with pytest.raises(ConfigurationError) as raised:
        lrl.configure(store=store)
    message = str(raised.value)
    assert "\n" not in message and "LIGHTNING_RL_REDACT='no_such_module_xyz:scrub'" in message and "PYTHONPATH" in message
    ran = []

    @lrl.trace
    def agent(question: str) -> None:
        ran.append(question)

    with pytest.raises(ConfigurationError, match="LIGHTNING_RL_REDACT"):
        agent(SECRET)
    assert ran == [] and files_holding(folder, SECRET) == []
    lrl.configure(store=store, redact="tests.tracer.redactors:scrub")  # a bad one changed nothing; a string works
    agent(SECRET)
    store.flush()
    assert [r.task for r in store.rollouts()] == ["[card]"] and files_holding(folder, SECRET) == []


def _python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_environment_variable_redacts_a_process_that_never_calls_configure(tmp_path):
    db = tmp_path / "env.db"
    code = ("import lightning_rl as lrl\n"
            "from tests.tracer.redactors import SECRET\n"
            "@lrl.trace\n"
            "def agent(q):\n"
            "    with lrl.tool_span('lookup', arguments=q) as t:\n"
            "        t.result = 'found ' + q\n"
            "    return 1.0\n"
            "agent('card ' + SECRET)\n"
            "print(lrl.stats().get('redaction_failed', 0))\n")
    done = _python(code, {"LIGHTNING_RL_STORE": f"sqlite:///{db}", "LIGHTNING_RL_REDACT": "tests.tracer.redactors:scrub"},
                   tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
    assert files_holding(tmp_path, SECRET) == [] and files_holding(tmp_path, "found card [card]") != []
    bad = _python("import lightning_rl", {"LIGHTNING_RL_REDACT": "tests.tracer.redactors.scrub"}, tmp_path)
    assert bad.returncode != 0
    assert ("ConfigurationError: LIGHTNING_RL_REDACT='tests.tracer.redactors.scrub' is not module:function"
            in bad.stderr.strip().splitlines()[-1])
    unknown = _python("import lightning_rl as lrl; lrl.configure()", {"LIGHTNING_RL_REDACT": "tests.nothing_here:f",
                                                                      "LIGHTNING_RL_STORE": f"sqlite:///{db}"}, tmp_path)
    assert unknown.returncode != 0
    assert "LIGHTNING_RL_REDACT='tests.nothing_here:f': module 'tests.nothing_here' cannot be imported" in unknown.stderr


def test_without_a_function_nothing_changes(redaction, sqlite_in):
    folder, store = sqlite_in
    lrl.configure(store=store)
    assert tracing.redaction() is None

    @lrl.trace
    def agent(question: str) -> float:
        return 1.0

    agent(SECRET)
    store.flush()
    assert files_holding(folder, SECRET) != []  # the check above can fail


def test_messages_stay_json_with_roles_names_and_ids_and_every_text_redacted():
    from lightning_rl.tracer.redaction import Pass

    import orjson

    openai_style = [{"role": "assistant", "content": None, "tool_calls": [{"id": "call-1", "type": "function", "function": {
        "name": "lookup_card", "arguments": f'{{"card": "{SECRET}"}}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": f"card {SECRET}"},
        {"role": "user", "content": [{"type": "text", "text": f"and {SECRET}?"}]}]
    anthropic_style = [{"role": "assistant", "content": [{"type": "tool_use", "id": "tu-1", "name": "lookup_card",
                                                          "input": {"card": SECRET}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu-1", "content": SECRET}]}]
    p = Pass(scrub)
    out = orjson.loads(p.messages(orjson.dumps(openai_style).decode()))
    assert out[0]["tool_calls"][0] == {"id": "call-1", "type": "function", "function": {
        "name": "lookup_card", "arguments": '{"card": "[card]"}'}}
    assert out[1] == {"role": "tool", "tool_call_id": "call-1", "content": "card [card]"}
    assert out[2]["content"] == [{"type": "text", "text": "and [card]?"}]
    out = orjson.loads(p.messages(orjson.dumps(anthropic_style).decode()))
    assert out[0]["content"][0] == {"type": "tool_use", "id": "tu-1", "name": "lookup_card", "input": {"card": "[card]"}}
    assert out[1]["content"][0] == {"type": "tool_result", "tool_use_id": "tu-1", "content": "[card]"}
    assert p.changed and not p.failed
    assert Pass(scrub).messages(f"not json {SECRET}") == "not json [card]"
