"""Replica sets without a vLLM server (``trainer_bridge/replicas.py``): how a set is given, and how a traced call
for the stable name is sent to the live version's own name and stamped with it (a real HTTP engine on
127.0.0.1 speaking vLLM's wire format; the real vLLM servers are in ``test_replicas_vllm.py``)."""

from __future__ import annotations

import openai
import pytest

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl.errors import ConfigurationError
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.replicas import Replicas, replica_urls, versioned_name

from ..adapters.vllm_like import VLLMLike


def test_a_replica_set_is_a_url_a_comma_list_or_a_list():
    assert replica_urls("http://a:8000/v1") == ("http://a:8000",)
    assert replica_urls("http://a:8000, http://b:8000/,http://a:8000") == ("http://a:8000", "http://b:8000")
    assert replica_urls(["http://a:8000,http://b:8000", "https://c:443"]) == (
        "http://a:8000", "http://b:8000", "https://c:443")
    assert Replicas(Replicas("http://a:8000")).urls == ("http://a:8000",)
    assert versioned_name("policy", 5) == "policy@v5"
    with pytest.raises(ConfigurationError, match="a replica URL must be http.*got 'a:8000'"):
        replica_urls("http://b:8000,a:8000")
    with pytest.raises(ConfigurationError, match="no replica URL in ' , '"):
        replica_urls(" , ")
    with pytest.raises(ConfigurationError, match="replicas must be a URL, a comma list of URLs or a list"):
        replica_urls(8000)
    with pytest.raises(ConfigurationError, match="keep must be an int >= 1"):
        Replicas("http://a:8000", keep=0)


@pytest.fixture
def engine():
    with VLLMLike() as e:
        yield e
    tracing.reset_policy_versions()


def test_a_traced_call_goes_to_the_live_version_s_own_name_and_is_stamped_with_it(traced, engine):
    client = openai.OpenAI(base_url=engine.base_url, api_key="EMPTY")

    @lrl.trace
    def agent(q):
        return client.chat.completions.create(model="policy", messages=[{"role": "user", "content": q}]).model

    traced.record_policy("policy", 3, adapter="/a/v3")  # loaded in place only: sent as asked
    assert agent("a") == "policy"
    tracing.reset_policy_versions()  # read the store anew (as a process does every second)
    traced.record_policy("policy", 4, adapter="/a/v4", served_as="policy@v4")
    assert agent("b") == "policy"  # the answer names the model asked for (agents compare them)
    tracing.set_policy_version(5, model="policy", served_as="policy@v5")  # this process's own publish wins
    assert agent("c") == "policy"
    assert [r["model"] for r in engine.requests] == ["policy", "policy@v4", "policy@v5"]
    calls = [t.llm_calls[0] for t in lrl.trajectories(traced)]
    # the model asked for is kept (samples are routed to policies by it); the version is the one that answered
    assert [(c.model, c.policy_version) for c in calls] == [("policy", 3), ("policy", 4), ("policy", 5)]
    answered = [{s.span_id: s for s in traced.spans(t.rollout_id)}[t.llm_calls[0].span_id]
                .attributes.get(semconv.GEN_AI_RESPONSE_MODEL) for t in lrl.trajectories(traced)]
    assert answered == ["policy", "policy@v4", "policy@v5"]  # the span keeps the name that answered


def test_a_server_without_the_lora_route_is_named_with_the_flag_at_once(tmp_path):
    """An OpenAI-compatible server that lists models but has no /v1/load_lora_adapter (not vLLM, or vLLM
    without runtime LoRA updating): one error naming the flag, not three retries and a shared-path hint."""
    import time

    from fastapi import FastAPI

    from lightning_rl.errors import PublishError
    from lightning_rl.serving import ServerThread

    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    server = ServerThread(app, name="openai-like")
    server.start("an OpenAI-like server")
    try:
        adapter = tmp_path / "v00001"
        adapter.mkdir()
        started = time.monotonic()
        with pytest.raises(PublishError, match="has no /v1/load_lora_adapter route.*VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
            Replicas(server.url, retries=3, backoff=0.5).publish("policy", 1, adapter)
        assert time.monotonic() - started < 1.0  # not retried: the route will not appear
    finally:
        server.stop()
