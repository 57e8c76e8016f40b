"""docs/extending.md's "Add a framework adapter", followed with a toy framework: a third party's adapter is
registered, instrumented when its framework's import finishes (or at registration, when it is loaded already),
and its contract (``instrument() -> bool``; a failure never reaches the user's program) holds. Each case runs
in a fresh interpreter: registering and the import hook are per process. No model: the toy records a tool span."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TOY_FRAMEWORK = '''
class Tool:
    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class Agent:
    def __init__(self, name, tools):
        self.name, self.tools = name, tools

    def run(self, task):
        return [tool(task) for tool in self.tools]
'''

# The adapter module, as docs/extending.md shows it (the framework imported inside instrument()).
TOY_ADAPTER = '''
"""lightning-rl's adapter for toyframework."""
from lightning_rl.adapters.wrapping import name_agent, record_tool


def instrument() -> bool:
    try:
        from toyframework import Agent, Tool
    except ImportError:
        return False
    name_agent(Agent, "run", lambda agent: agent.name)
    record_tool(Tool, "__call__", lambda tool: tool.name, lambda tool, args, kwargs: {"text": args[0]})
    return True
'''

# The plugin a user imports: it registers the adapter, lazily (toy_adapter is imported with toyframework).
TOY_PLUGIN = '''
from lightning_rl.adapters import FRAMEWORKS, lazy

FRAMEWORKS.add("toyframework", lazy("toy_adapter:instrument"))
'''

# The decorator form: the adapter's function registered where it is defined.
TOY_PLUGIN_DECORATED = '''
from lightning_rl.adapters import register_framework
from lightning_rl.adapters.wrapping import name_agent, record_tool


@register_framework("toyframework")
def instrument() -> bool:
    from toyframework import Agent, Tool

    name_agent(Agent, "run", lambda agent: agent.name)
    record_tool(Tool, "__call__", lambda tool: tool.name, lambda tool, args, kwargs: {"text": args[0]})
    return True
'''

RUN_AND_CHECK = '''
import lightning_rl as lrl
from lightning_rl import adapters

store = lrl.configure(store=STORE)

@lrl.trace
def agent(task):
    return toyframework.Agent("researcher", [toyframework.Tool("lookup", len)]).run(task)

assert agent("hello") == [5]
(rollout,) = store.rollouts()
tools = [span for span in store.spans(rollout.rollout_id) if span.name.startswith("execute_tool")]
assert [span.name for span in tools] == ["execute_tool lookup"], f"no tool span: {tools}"
assert adapters.instrumented()["toyframework"] is True, adapters.instrumented()
assert not [cause for cause in lrl.stats() if "instrument" in cause], lrl.stats()  # (no model: no LLM call)
print("ok")
'''


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    (tmp_path / "toyframework").mkdir()
    (tmp_path / "toyframework" / "__init__.py").write_text(TOY_FRAMEWORK)
    (tmp_path / "toy_adapter.py").write_text(TOY_ADAPTER)
    (tmp_path / "toy_plugin.py").write_text(TOY_PLUGIN)
    (tmp_path / "toy_plugin_decorated.py").write_text(TOY_PLUGIN_DECORATED)
    return tmp_path


def _python(toy: Path, code: str) -> subprocess.CompletedProcess:
    code = f"import sys\nsys.path.insert(0, {str(toy)!r})\nSTORE = {str(toy / 'runs.db')!r}\n" + textwrap.dedent(code)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=toy)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_lazy_adapter_is_imported_with_its_framework_and_instruments_it(toy):
    result = _python(toy, textwrap.dedent("""
        import lightning_rl
        import toy_plugin
        assert "toy_adapter" not in sys.modules and "toyframework" not in sys.modules  # nothing paid for yet
        import toyframework  # the hook imports toy_adapter and instruments toyframework here
        assert "toy_adapter" in sys.modules
    """) + RUN_AND_CHECK)
    assert result.stdout.strip() == "ok"


def test_a_decorated_adapter_instruments_its_framework_on_import(toy):
    result = _python(toy, textwrap.dedent("""
        import lightning_rl
        import toy_plugin_decorated
        import toyframework
    """) + RUN_AND_CHECK)
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("plugin", ["toy_plugin", "toy_plugin_decorated"])
def test_a_framework_imported_before_its_adapter_is_registered_is_instrumented_at_registration(toy, plugin):
    result = _python(toy, textwrap.dedent(f"""
        import toyframework
        import lightning_rl
        import {plugin}
    """) + RUN_AND_CHECK)
    assert result.stdout.strip() == "ok"


def test_without_its_adapter_the_toy_framework_is_not_instrumented(toy):
    """The check above can fail: the same program with no adapter registered records no tool span."""
    result = subprocess.run([sys.executable, "-c", f"import sys\nsys.path.insert(0, {str(toy)!r})\n"
                             f"STORE = {str(toy / 'runs.db')!r}\nimport toyframework\n" + RUN_AND_CHECK],
                            capture_output=True, text=True, timeout=240, cwd=toy)
    assert result.returncode == 1 and "AssertionError: no tool span: []" in result.stderr, result.stderr[-3000:]
    assert "ok" not in result.stdout


def test_the_contract_false_is_absent_a_wrong_answer_or_an_error_is_counted_never_raised(toy):
    for name, body in [("toy_absent", "return False"), ("toy_forgot", "pass"),
                       ("toy_broken", "raise AttributeError('toy_broken has no Agent')")]:
        (toy / f"{name}.py").write_text("X = 1\n")
        (toy / f"{name}_adapter.py").write_text(f"def instrument():\n    {body}\n")
    result = _python(toy, textwrap.dedent("""
        import lightning_rl
        from lightning_rl import adapters
        from lightning_rl.errors import ConfigurationError
        for name in ("toy_absent", "toy_forgot", "toy_broken"):
            adapters.FRAMEWORKS.add(name, adapters.lazy(f"{name}_adapter:instrument"))
            mod = __import__(name)  # the user's import goes through, whatever the adapter did
            assert mod.X == 1
        toys = {name: done for name, done in adapters.instrumented().items() if name.startswith("toy_")}
        assert toys == {"toy_absent": False}, toys  # a wrong answer is counted, not taken for one
        counted = lightning_rl.stats()
        assert counted == {"instrumenting toy_forgot": 1, "instrumenting toy_broken": 1}, counted
        try:
            adapters.register_framework("langchain_core")(lambda: True)
        except ConfigurationError as exc:
            print(exc)
    """))
    assert result.stdout.strip() == (
        "a framework adapter named 'langchain_core' is registered already "
        "(lazy('lightning_rl.adapters.langchain:instrument_framework')); register __main__.<lambda> under another name")
    assert "returned None, not True or False" in result.stderr and "toy_broken has no Agent" in result.stderr


@pytest.mark.parametrize("target", ["toy_adapter", "toy_adapter:", ":instrument", "toy adapter:instrument", 3])
def test_a_lazy_adapter_is_named_module_colon_function(target):
    from lightning_rl.adapters import lazy
    from lightning_rl.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="a lazy framework adapter is named 'package.module:function', got"):
        lazy(target)
    assert repr(lazy("toy_adapter:instrument")) == "lazy('toy_adapter:instrument')"
