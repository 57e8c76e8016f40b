"""Capture: one LLM exchange recorded with the engine's ids (:mod:`.exchange`) and the protocols answered
through chat completions (:mod:`.dialects`).

Its own part, below both of its users: the framework adapters (the openai client, the HTTP layer) and the
gateway import it and never each other; it imports only the tracer and the bottom (tests/test_layers.py).
"""

from .exchange import (CapturedCall, Server, gc_paused, refused_token_fields, resend_without_token_fields,
                       takes_token_fields)

__all__ = ["CapturedCall", "Server", "gc_paused", "refused_token_fields", "resend_without_token_fields",
           "takes_token_fields"]
