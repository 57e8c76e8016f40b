"""``lightning-rl gateway --redact module:function`` (issue 36), the real command in front of the real vLLM
server: the secret in a rollout's task, a proxied call's messages, an agent's OTLP tool span and the finish's
error reaches no file of the gateway's SQLite store; names stay; the call's token ids are dropped. A bad
value stops the command at start-up with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.cli import main
from lightning_rl.store import SQLiteStore
from lightning_rl.tracer import tracing
from lightning_rl.vllm_server import free_port

from ..conftest import SERVED_NAME
from ..services import wait_healthy
from ..tracer.redactors import CANARY, SECRET
from ..tracer.test_redaction import files_holding

pytestmark = [pytest.mark.vllm]
ROOT = Path(__file__).resolve().parents[2]


def test_the_gateway_command_redacts_what_it_records(vllm_url, tmp_path):
    folder = tmp_path / "store"
    folder.mkdir()
    port = free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "lightning_rl.cli", "gateway", "--upstream", vllm_url, "--store",
         f"sqlite:///{folder / 'gw.db'}", "--port", str(port), "--redact", "tests.tracer.redactors:scrub"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, gateway, what="the gateway")
        opened = httpx.post(f"{url}/v1/rollouts", json={"task": {"card": SECRET, "note": CANARY},
                                                         "agent": "billing"}).json()
        client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"])
        client.chat.completions.create(model=SERVED_NAME, max_tokens=4, temperature=0.0, seed=0, messages=[
            {"role": "user", "content": f"My card is {SECRET}. {CANARY}"}])
        provider = TracerProvider()  # the agent's own OpenTelemetry SDK: a tool span over OTLP
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(
            endpoint=opened["base_url"] + "/traces", headers={"authorization": f"Bearer {opened['api_key']}"})))
        with provider.get_tracer("agent").start_as_current_span("lookup_card", attributes={
                semconv.GEN_AI_TOOL_NAME: "lookup_card", semconv.TOOL_RESULT: f"card {SECRET} is valid"}):
            pass
        provider.shutdown()
        finished = httpx.post(f"{url}/v1/rollouts/{opened['rollout_id']}/finish", headers={
            "authorization": f"Bearer {opened['api_key']}"}, json={"status": "failed", "error": f"card {SECRET} declined"})
        assert finished.status_code == 200, finished.text
    finally:
        gateway.terminate()
        gateway.wait(30)
    assert files_holding(folder, SECRET) == [] and files_holding(folder, CANARY) != []
    store = SQLiteStore(folder / "gw.db")
    try:
        traj = lrl.trajectory(store, opened["rollout_id"])
        assert traj.task == {"card": "[card]", "note": CANARY} and traj.error == "card [card] declined"
        (call,) = traj.llm_calls
        assert call.input_messages == [{"role": "user", "content": f"My card is [card]. {CANARY}"}]
        assert call.model == SERVED_NAME and call.token_ids_source == "missing" and call.prompt_token_ids == []
        (tool,) = traj.tool_spans
        assert tool.attributes[semconv.GEN_AI_TOOL_NAME] == "lookup_card"
        assert tool.attributes[semconv.TOOL_RESULT] == "card [card] is valid"
    finally:
        store.close()


def test_a_bad_redact_value_stops_the_gateway_at_start_up_with_one_line(tmp_path):
    result = CliRunner().invoke(main, ["gateway", "--upstream", "http://127.0.0.1:9", "--store",
                                       f"sqlite:///{tmp_path / 'gw.db'}", "--redact", "no_such_module_xyz:scrub"])
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert "--redact='no_such_module_xyz:scrub'" in line and "cannot be imported" in line
    assert tracing.redaction() is None  # the command ended; nothing refused is left in this process's set-up
    assert not (tmp_path / "gw.db").exists()  # it stopped before opening the store
