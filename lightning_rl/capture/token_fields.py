"""Which servers get the token fields (``return_token_ids``, ``logprobs``), kept by :class:`Server`, and the
one resend without them when a server refuses them: the capture core's policy (``exchange.py``).

The rule:

* never api.openai.com or api.anthropic.com, nor the hosts in ``LIGHTNING_RL_NO_INJECT_HOSTS``;
* a server that answered with token ids is known to take them (:data:`takes_token_fields`);
* any other server gets them on its first call; if it refuses that request (400 or 422) naming one of
  them (or saying it refuses fields it does not know), the entry point sends it once more without them
  (:func:`resend_without_token_fields`), the server is remembered as one that does not take them, and
  the fallback is counted (``llm_requests_resent_without_token_fields``) and logged once. Any other
  refusal (a context-length error) goes back to the agent after one request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..diagnostics import count, report_failure
from ..tracer.provider import tracing

if TYPE_CHECKING:
    from .exchange import CapturedCall


#: Hosted APIs: their requests are never changed (they refuse unknown fields, and return no ids anyway).
HOSTED = frozenset({"api.openai.com", "api.anthropic.com"})
#: "host:port" -> True (answered with token ids) / False (refused the fields); absent: not known yet
takes_token_fields: dict[str, bool] = {}


@dataclass(frozen=True, slots=True)
class Server:
    """The engine an exchange goes to: its host and port (what the token-field policy is kept by)."""

    host: str | None
    port: int | None

    @classmethod
    def from_url(cls, url: Any) -> "Server":
        """From a URL (a string, or an httpx/httpx2 URL)."""
        host = getattr(url, "host", None)
        if host is not None:
            return cls(host or None, getattr(url, "port", None))
        parts = urlsplit(str(url))
        return cls(parts.hostname, parts.port)

    @property
    def key(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def hosted(self) -> bool:
        return self.host in HOSTED or self.host in tracing.settings.no_inject_hosts


_UNKNOWN_FIELD_WORDS = ("extra inputs are not permitted", "extra_forbidden", "unrecognized request argument",
                        "unknown field", "unknown parameter", "unexpected keyword", "additional properties")


def _refuses_token_fields(error: BaseException, injected: tuple[str, ...]) -> bool:
    """Whether a 400/422 is about the fields we added: its text names one, or says it refuses unknown
    fields. Any other refusal (a context-length error, a bad message) is the agent's, sent once."""
    body = getattr(error, "body", None)
    text = f"{error} {body if body is not None else ''}".lower()
    return any(field in text for field in injected) or any(words in text for words in _UNKNOWN_FIELD_WORDS)


def resend_without_token_fields(call: CapturedCall, error: BaseException) -> bool:
    """Whether to send the request once more without the fields we added: the server refused it
    (400/422) because of them, and it is not known to take them. If so, ``call.extra`` no longer
    holds them: the entry point sends the request again with what is left."""
    if not call.injected or takes_token_fields.get(call.server) is not None:
        return False
    if getattr(error, "status_code", None) not in (400, 422):
        return False
    if not _refuses_token_fields(error, call.injected):
        count("llm_requests_refused_not_for_token_fields")  # the agent's own error: answered after one request
        return False
    call.extra = {k: v for k, v in call.extra.items() if k not in call.injected}
    call.injected = ()
    return True


def refused_token_fields(call: CapturedCall) -> None:
    """The request went through without the token fields: remember the server, count, log once."""
    takes_token_fields[call.server] = False
    count("llm_requests_resent_without_token_fields")
    report_failure(f"token fields refused by {call.server}", message=(
        f"lightning-rl: the server at {call.server} refused return_token_ids/logprobs (HTTP 400/422); the "
        "request was sent again without them, and calls to it are recorded without token ids (not trained on). "
        "Serve the model with vLLM >= 0.10.2 to train on these calls, or list the host in "
        "LIGHTNING_RL_NO_INJECT_HOSTS to skip the first try"))
