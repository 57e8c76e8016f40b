"""Framework adapters. Each emits spans through the tracer only; optional frameworks are imported
only inside their own module, and only once the user's program has imported them."""

from __future__ import annotations

import sys

from ..diagnostics import report_failure

# framework module that signals it is in use -> adapter module to instrument it
_FRAMEWORKS = {
    "langchain_core": "lightning_rl.adapters.langchain",
    "autogen_agentchat": "lightning_rl.adapters.autogen",
}
_done: set[str] = set()


def instrument_loaded() -> None:
    """Instrument every supported framework the program has imported (cheap; runs at rollout start).

    LangChain and AutoGen are not imported by lightning_rl itself (that would cost users who do not
    use them a second at import); a framework imported during a rollout is picked up at the next.
    """
    if len(_done) == len(_FRAMEWORKS):
        return
    for framework, adapter in _FRAMEWORKS.items():
        if framework in _done or framework not in sys.modules:
            continue
        _done.add(framework)
        try:
            __import__(adapter, fromlist=["instrument"]).instrument()
        except Exception as exc:
            report_failure(f"instrumenting {framework}", exc)
