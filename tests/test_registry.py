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


def test_get_with_a_default_answers_it_for_an_unknown_name_as_a_dict_does():
    table = Registry("widget")
    table.register("one")(len)
    assert table.get("one", None) is len
    assert table.get("two", None) is None and table.get(["unhashable"], abs) is abs


def test_of_a_type_holds_instances_of_it_instead_of_callables():
    table = Registry("colour", of=tuple)
    table.add("red", (255, 0, 0))
    assert table.get("red") == (255, 0, 0) and table.values() == [(255, 0, 0)]
    with pytest.raises(ConfigurationError, match=r"a colour must be a tuple, got 'blue' for 'blue'"):
        table.add("blue", "blue")


def test_integer_keys_sort_as_numbers_and_refuse_strings_and_bools():
    table = Registry("step", key=int)
    for version in (10, 2, 1):
        table.add(version, len)
    assert table.names() == [1, 2, 10] and list(table) == [1, 2, 10] and 2 in table
    for bad in ("3", True, 2.0):
        with pytest.raises(ConfigurationError, match="a step is registered under an integer"):
            table.add(bad, abs)
    with pytest.raises(UnknownNameError, match=r"unknown step 3; known: 1, 2, 10"):
        table.get(3)


def test_an_ordered_registry_keeps_registration_order():
    ordered, plain = Registry("resolver", ordered=True), Registry("resolver")
    for table in (ordered, plain):
        table.add("zeta", len)
        table.add("alpha", abs)
    assert ordered.names() == ["zeta", "alpha"] == list(ordered) and ordered.values() == [len, abs]
    assert plain.names() == ["alpha", "zeta"] and plain.values() == [abs, len]


def test_traits_an_entry_declares_are_read_back_and_default_otherwise():
    table = Registry("estimator", traits={"needs_groups": False})

    @table.register("grouped", needs_groups=True)
    def grouped():
        return 1

    table.add("plain", len)
    assert grouped() == 1  # the decorator still returns the function unchanged
    assert table.trait("grouped", "needs_groups") is True and table.trait("plain", "needs_groups") is False
    with pytest.raises(ConfigurationError, match=r"no trait 'needs_group' \(for 'x'\); known traits: needs_groups"):
        table.register("x", needs_group=True)
    with pytest.raises(ConfigurationError, match="declares no trait 'colour'"):
        table.trait("plain", "colour")
    with pytest.raises(UnknownNameError, match="unknown estimator 'nope'"):
        table.trait("nope", "needs_groups")
    with pytest.raises(ConfigurationError, match="declares no trait 'a'.*known traits: none"):
        Registry("widget").add("w", len, a=1)


def test_the_remaining_tables_are_registries_too():
    from lightning_rl.adapters import FRAMEWORKS, lazy
    from lightning_rl.capture.dialects import DIALECTS, MESSAGES, RESPONSES
    from lightning_rl.store.sqlite.migrations import MIGRATIONS
    from lightning_rl.tracer.context import AGENT_RESOLVERS

    for registry in (FRAMEWORKS, DIALECTS, MIGRATIONS, AGENT_RESOLVERS):
        assert isinstance(registry, Registry)
    assert {"langchain_core", "google.adk", "httpx"} <= set(FRAMEWORKS)
    assert all(isinstance(FRAMEWORKS.get(name), lazy) for name in FRAMEWORKS)  # nothing imported before its framework
    assert DIALECTS.names() == ["messages", "responses"]
    assert DIALECTS.get("messages") is MESSAGES and DIALECTS.get("responses") is RESPONSES
    assert DIALECTS.get("chat", None) is None  # chat completions need no dialect: the callers' "not one" answer
    with pytest.raises(ConfigurationError, match="a capture dialect must be a Dialect, got"):
        DIALECTS.add("completions", lambda body: body)
    with pytest.raises(ConfigurationError, match="capture dialect named 'messages' is registered already"):
        DIALECTS.add("messages", RESPONSES)
    assert DIALECTS.get("messages") is MESSAGES
