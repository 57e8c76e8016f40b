"""Agent-name resolvers (a framework's own agent context, registered by its adapter) are one ordered registry:
asked after ``agent_scope``, in the order registered, the first name given wins; a failing one is counted and
skipped. The resolvers here answer only inside these tests (a context variable), so the registry they stay in
for the rest of the process changes no other test."""

from __future__ import annotations

from contextvars import ContextVar

import pytest

import lightning_rl as lrl
from lightning_rl.errors import ConfigurationError
from lightning_rl.registry import Registry
from lightning_rl.tracer.context import AGENT_RESOLVERS, agent_scope, current_agent_name, register_agent_resolver

_answers: ContextVar[dict[str, object] | None] = ContextVar("test_resolver_answers", default=None)


def _answer(key: str) -> str | None:
    answer = (_answers.get() or {}).get(key)
    if isinstance(answer, Exception):
        raise answer
    return answer


def zulu_resolver_registered_first() -> str | None:
    return _answer("first")


def alpha_resolver_registered_second() -> str | None:
    return _answer("second")


# registered in an order their names do not sort in: the order asked is the order registered
register_agent_resolver(zulu_resolver_registered_first)
register_agent_resolver(alpha_resolver_registered_second)


@lrl.trace(agent="traced-agent")
def _named(answers: dict[str, object]) -> tuple[str | None, str | None]:
    token = _answers.set(answers)
    try:
        with agent_scope("scoped"):
            scoped = current_agent_name()
        return scoped, current_agent_name()
    finally:
        _answers.reset(token)


def _failures() -> dict[str, int]:
    return {cause: n for cause, n in lrl.stats().items() if cause.startswith("agent name")}  # (no model: no LLM call)


def test_the_resolvers_are_an_ordered_registry_asked_in_registration_order(traced):
    assert isinstance(AGENT_RESOLVERS, Registry) and AGENT_RESOLVERS.ordered
    names = AGENT_RESOLVERS.names()
    first, second = f"{__name__}.zulu_resolver_registered_first", f"{__name__}.alpha_resolver_registered_second"
    assert names.index(first) < names.index(second)
    assert _named({"first": "planner", "second": "solver"}) == ("scoped", "planner")  # agent_scope, then the first
    assert _named({"second": "solver"}) == ("scoped", "solver")  # the first says None: the next is asked
    assert _named({}) == ("scoped", "traced-agent")  # none says: the traced function's agent
    assert _failures() == {}


def test_a_failing_resolver_is_counted_and_the_next_one_answers(traced):
    assert _named({"first": RuntimeError("framework internals changed"), "second": "solver"}) == ("scoped", "solver")
    assert _failures() == {f"agent name from {__name__}": 1}


def test_registering_the_same_resolver_again_does_nothing_and_another_under_its_name_is_refused():
    before = AGENT_RESOLVERS.names()
    register_agent_resolver(zulu_resolver_registered_first)
    assert AGENT_RESOLVERS.names() == before
    taken = f"{__name__}.zulu_resolver_registered_first"
    with pytest.raises(ConfigurationError, match=rf"agent-name resolver named '{taken}' is registered already"):
        register_agent_resolver(lambda: None, name=f"{__name__}.zulu_resolver_registered_first")
    assert AGENT_RESOLVERS.names() == before
