"""One registry type behind every named extension point: register returns the function, a duplicate is
refused, an unknown name lists the known ones."""

import pytest

from lightning_rl import rewards
from lightning_rl.errors import ConfigurationError, UnknownNameError
from lightning_rl.registry import Registry
from lightning_rl.store.credit import CREDIT_ASSIGNERS
from lightning_rl.trainer_bridge.algorithms import ADV_ESTIMATORS, POLICY_LOSSES
from lightning_rl.trainer_bridge.loggers import LOGGERS
from lightning_rl.trainer_bridge.publishers import PUBLISHERS


def test_register_returns_the_function_unchanged_and_get_finds_it():
    table = Registry("widget")

    @table.register("one")
    def one():
        return 1

    assert one() == 1 and table.get("one") is one
    assert "one" in table and list(table) == ["one"] and len(table) == 1


def test_a_duplicate_name_is_refused_naming_what_holds_it():
    table = Registry("widget")
    table.register("one")(len)
    with pytest.raises(ConfigurationError, match=r"widget named 'one' is registered already \(builtins.len\)"):
        table.register("one")(abs)
    assert table.get("one") is len  # the first stays


def test_an_unknown_name_lists_the_known_ones_and_the_hint():
    table = Registry("widget", hint="or register one with @register_widget")
    table.register("b")(len)
    table.register("a")(abs)
    with pytest.raises(UnknownNameError, match=r"unknown widget 'c'; known: a, b \(or register one with @register_widget\)"):
        table.get("c")
    with pytest.raises(UnknownNameError):
        table.get(["not", "hashable"])


@pytest.mark.parametrize("name,obj", [("", len), (3, len), ("x", 3)])
def test_a_bad_name_or_a_non_callable_is_refused(name, obj):
    with pytest.raises(ConfigurationError):
        Registry("widget").register(name)(obj)


@pytest.mark.parametrize("registry,builtin", [
    (CREDIT_ASSIGNERS, "final"), (ADV_ESTIMATORS, "grpo"), (POLICY_LOSSES, "vanilla"),
    (rewards.REWARD_HELPERS, "exact_match"), (PUBLISHERS, "vllm_lora"), (LOGGERS, "tensorboard"),
])
def test_every_registry_is_one_and_refuses_replacing_a_builtin(registry, builtin):
    assert isinstance(registry, Registry)
    held = registry.get(builtin)
    with pytest.raises(ConfigurationError, match="registered already"):
        registry.register(builtin)(lambda *a, **k: None)
    assert registry.get(builtin) is held
