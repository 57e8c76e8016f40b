"""docs/extending.md followed as written, for the extensions that need no server: a weight publisher and a
reward helper, registered by name, used through the public API, recorded in a real SQLite store. (The store
backend's section: tests/store/toy_store.py; the framework adapter's: tests/adapters.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import lightning_rl as lrl
from lightning_rl import rewards
from lightning_rl.errors import ConfigurationError, PublishError
from lightning_rl.rewards import REWARD_HELPERS, Score, register_reward_helper
from lightning_rl.trainer_bridge import PUBLISHERS, make_publisher, register_publisher
from lightning_rl.trainer_bridge.publishers import publish_and_record
from lightning_rl.tracer import tracing


@pytest.fixture
def registered():
    """Names this test registers, taken out of the process-wide registries after it."""
    names: list[tuple[object, str]] = []
    yield lambda registry, name: names.append((registry, name))
    for registry, name in names:
        registry._entries.pop(name, None)  # a test's own registration only


class Weights:
    """What a trainer hands a publisher: a model with ``save_pretrained`` (as a PEFT model has)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def save_pretrained(self, path: str) -> None:
        if self.fail:
            raise PublishError(f"{path}: the bucket refused the upload")
        Path(path).mkdir(parents=True)
        (Path(path) / "adapter_model.safetensors").write_bytes(b"weights")


def test_a_publisher_from_the_docs_is_recorded_and_every_traced_process_stamps_its_version(traced, tmp_path,
                                                                                        registered):
    @register_publisher("bucket")
    class BucketPublisher:  # docs/extending.md, "Add a weight publisher"
        def __init__(self, *, bucket: str, served_name: str = "policy") -> None:
            self.bucket, self.served_name = bucket, served_name

        def publish(self, model, version: int) -> str:
            path = f"{self.bucket}/v{version:05d}"
            model.save_pretrained(path)
            return path

    registered(PUBLISHERS, "bucket")
    publisher = make_publisher("bucket", bucket=str(tmp_path / "bucket"))
    assert publish_and_record(publisher, traced, Weights(), 3, trained_on=["g1"]) == f"{tmp_path}/bucket/v00003"
    (record,) = traced.policies("policy")
    assert (record.version, record.adapter, record.trained_on) == (3, f"{tmp_path}/bucket/v00003", ["g1"])
    assert (tmp_path / "bucket" / "v00003" / "adapter_model.safetensors").is_file()
    tracing.reset_policy_versions()  # read the store now, as every process does at its next refresh
    assert tracing.versions.version("policy") == 3
    # a publish that fails is not recorded: the version stays where it was
    with pytest.raises(PublishError, match="refused the upload"):
        publish_and_record(publisher, traced, Weights(fail=True), 4)
    assert [p.version for p in traced.policies("policy")] == [3]
    # the name is the publisher's: a second registration under it is refused, naming who holds it
    with pytest.raises(ConfigurationError, match="'bucket' is registered already"):
        register_publisher("bucket")(BucketPublisher)


def test_a_reward_helper_from_the_docs_stores_its_total_and_parts(traced, registered):
    @register_reward_helper("mentions")
    def mentions(answer, word: str) -> Score:  # docs/extending.md, "Add a reward helper"
        if not word:
            raise ConfigurationError("mentions needs a non-empty word, got ''")
        return Score(1.0 if word.casefold() in str(answer).casefold() else 0.0, "mentions")

    registered(REWARD_HELPERS, "mentions")
    assert rewards.reward_helper("mentions") is mentions

    @lrl.trace(name="scored")
    async def agent(task: dict) -> Score:
        said = f"The sum is {task['a'] + task['b']}"
        return rewards.weighted(mentions(said, "sum"), rewards.numeric_match(said, 42), weights={"mentions": 0.5})

    asyncio.run(agent({"a": 12, "b": 30}))
    traced.flush()
    (rollout,) = traced.rollouts()
    stored = {r.name: r.value for r in traced.rewards(rollout.rollout_id)}
    assert stored == {"reward": 1.5, "mentions": 1.0, "numeric_match": 1.0}
    with pytest.raises(ConfigurationError, match="non-empty word"):
        mentions("anything", "")
