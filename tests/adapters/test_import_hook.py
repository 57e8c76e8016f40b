"""Frameworks are instrumented on import, whatever the order of imports (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_autogen_imported_after_lightning_rl_is_instrumented_by_its_import():
    pytest.importorskip("autogen_agentchat")
    _python("""
        import sys
        import lightning_rl
        assert "autogen_agentchat" not in sys.modules
        import autogen_agentchat  # nothing else: the hook instruments it here
        from autogen_agentchat.agents import _base_chat_agent
        from autogen_agentchat.teams._group_chat import _chat_agent_container
        from autogen_core.tools import _base
        for helper in (_base_chat_agent.trace_invoke_agent_span, _chat_agent_container.trace_invoke_agent_span,
                       _base.trace_tool_span):
            assert hasattr(helper, "__lightning_rl_original__"), helper
        # the framework's module keeps its own loader and spec
        assert type(autogen_agentchat.__loader__).__name__ == "SourceFileLoader", autogen_agentchat.__loader__
        assert autogen_agentchat.__spec__.loader is autogen_agentchat.__loader__
        assert lightning_rl.stats() == {}
    """)


def test_langchain_imported_after_lightning_rl_is_instrumented_by_its_import():
    pytest.importorskip("langchain_core")
    _python("""
        import sys
        import lightning_rl
        assert "langchain_core" not in sys.modules
        from langchain_openai import ChatOpenAI  # imports langchain_core on the way
        from langchain_core.tracers.context import _configure_hooks
        from lightning_rl.adapters import langchain as adapter
        assert adapter._handler is not None
        assert any(var.get() is adapter._handler for var, *_ in _configure_hooks)
    """)


def test_frameworks_imported_before_lightning_rl_are_instrumented_at_its_import():
    pytest.importorskip("autogen_agentchat")
    _python("""
        import autogen_agentchat, langchain_core
        import lightning_rl
        from autogen_agentchat.agents import _base_chat_agent
        from lightning_rl.adapters import langchain as adapter
        assert hasattr(_base_chat_agent.trace_invoke_agent_span, "__lightning_rl_original__")
        assert adapter._handler is not None
    """)


def test_a_failing_adapter_never_breaks_the_users_import():
    result = _python("""
        import sys
        import lightning_rl
        from lightning_rl import adapters
        adapters.FRAMEWORKS.add("colorsys", adapters.lazy("lightning_rl.no_such_adapter:instrument"))  # it will fail
        assert "colorsys" not in sys.modules
        import colorsys
        assert colorsys.rgb_to_hsv(1, 0, 0) == (0.0, 1.0, 1.0)
        assert lightning_rl.stats() == {"instrumenting colorsys": 1}, lightning_rl.stats()
        print("ok")
    """)
    assert result.stdout.strip() == "ok" and "instrumenting colorsys failed" in result.stderr


@pytest.mark.parametrize(("adapter", "framework", "check"), [
    ("langchain", "langchain_core", "adapter._handler is not None"),
    ("autogen", "autogen_agentchat",
     "hasattr(__import__('autogen_agentchat.agents', fromlist=['_base_chat_agent'])._base_chat_agent"
     ".trace_invoke_agent_span, '__lightning_rl_original__')"),
    ("openai_agents", "agents", "True"),
    ("pydanticai", "pydantic_ai", "True"),
])
def test_an_adapter_module_imported_before_its_framework_instruments_it(adapter, framework, check):
    """`import lightning_rl.adapters.langchain` first: the framework's import finishes inside the adapter's own,
    while the adapter is half-initialised; it is instrumented once the adapter module is done, not counted failed.
    (Adapters that import their framework lazily get it instrumented by its later import.)"""
    pytest.importorskip(framework)
    _python(f"""
        import sys
        assert {framework!r} not in sys.modules
        import lightning_rl.adapters.{adapter} as adapter
        import {framework}  # imported by the adapter already, or now
        import lightning_rl
        from lightning_rl import adapters
        assert {framework!r} in adapters._done, adapters._done
        assert lightning_rl.stats() == {{}}, lightning_rl.stats()
        assert {check}
    """)


def test_every_adapter_module_ends_by_instrumenting_what_waited_for_it():
    import re
    from pathlib import Path

    from lightning_rl import adapters

    for module in {entry.module for entry in adapters.FRAMEWORKS.values()}:
        source = Path(adapters.__file__).with_name(module.rpartition(".")[2] + ".py").read_text()
        assert re.search(r"\nmodule_ready\(__name__\)\n*$", source), f"{module} does not end with module_ready(__name__)"
