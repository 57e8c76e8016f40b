"""The capture core: one LLM exchange inside a rollout, recorded as a GenAI span with the engine's ids.

Every entry point builds the same record from what it has, never from another's objects: the openai
client adapter (``adapters/openai.py``), the HTTP layer (``adapters/http_clients.py``: httpx, httpx2,
requests, and the Responses and Anthropic Messages dialects sent to an engine as chat completions) and
the gateway. Each gives a :class:`CapturedCall` the server it talks to (:class:`Server`), the request
as a dict, and then the answer: a whole response, or stream chunks as they come (the engine's JSON as
dicts, or the openai client's objects). The call says which fields to add to the request
(``extra``: ``return_token_ids`` and ``logprobs``, and the trainer's sampling settings), and the
entry point sends them.

Which servers get the token fields (``return_token_ids``, ``logprobs``), and the one resend without them
when a server refuses them: ``token_fields.py`` (:class:`Server`, :data:`takes_token_fields`).

Where the server returns no ids the call is still recorded with ``token_ids.source = missing``.
Nothing here raises into the caller: failures are logged once per cause and counted.
"""

from __future__ import annotations

import contextlib
import gc
import operator
import threading
from typing import Any

import orjson
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import semconv
from ..diagnostics import count, report_failure
from ..records import PackedTokens
from ..tracer.context import RolloutState, _llm_hint, current_agent_name
from ..tracer.provider import parent_context, tracing
from .dialects.chat import strip
from .token_fields import HOSTED, Server, refused_token_fields, resend_without_token_fields, takes_token_fields

#: ``HOSTED``, ``Server``, ``takes_token_fields``, ``resend_without_token_fields`` and ``refused_token_fields``
#: (``token_fields.py``) are imported from here too.
__all__ = ["HOSTED", "CapturedCall", "Server", "gc_paused", "refused_token_fields", "resend_without_token_fields",
           "takes_token_fields"]

_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "seed", "n",
    "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
)
_GUIDED_KEYS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
_SAMPLING_ORDER = {key: i for i, key in enumerate(_SAMPLING_KEYS)}
#: What may make a request guided (``guided_decoding``): most requests have none of these keys.
_MAY_GUIDE = frozenset((*_GUIDED_KEYS, "response_format", "tool_choice"))


def guided_decoding(request: dict[str, Any]) -> str | None:
    """What constrained this request's sampling, if anything did (recorded as ``sampling_params["guided"]``): the
    engine's log-probs of a grammar-masked sample are of the masked distribution, which a trainer does not
    compute (docs/verl.md). A schema or JSON ``response_format``, vLLM's ``structured_outputs``/``guided_*``, and a
    ``tool_choice`` that forces a call (``required`` or a named function: vLLM enforces it with a grammar)."""
    if _MAY_GUIDE.isdisjoint(request):
        return None
    for key in _GUIDED_KEYS:
        if request.get(key):
            return key
    fmt = request.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_schema", "json_object"):
        return f"response_format:{fmt['type']}"
    choice = request.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "tool_choice"
    return None


_NUMERIC_REQUEST_ATTRIBUTES = (
    ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE), ("top_p", semconv.GEN_AI_REQUEST_TOP_P),
    ("seed", semconv.GEN_AI_REQUEST_SEED), ("max_tokens", semconv.GEN_AI_REQUEST_MAX_TOKENS),
    ("max_completion_tokens", semconv.GEN_AI_REQUEST_MAX_TOKENS),
)


class gc_paused:  # noqa: N801  (used as a function: ``with gc_paused():``)
    """The cyclic garbage collector held off while a whole answer is parsed and read (issue 57). Parsing a
    4,000+1,000-token answer with log-probs makes some 3,000 dicts and lists, which set off several collections of
    the young generation and, every few dozen answers, one of the whole heap: in a process with the openai client
    imported, ``orjson.loads`` of that answer took 1.4 ms with the collector on and 0.39 ms with it off. Nothing
    it makes is a cycle, and what is dropped before the block ends is freed by reference counting and never
    counted. The collector is turned back on only if it was on; one turned off meanwhile on another thread is
    turned on again here (the collector's switch is the process's, and it has no owner). A class, not a
    generator: it runs on every answer."""

    __slots__ = ("_was_on",)

    def __enter__(self) -> None:
        self._was_on = gc.isenabled()
        if self._was_on:
            gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self._was_on:
            gc.enable()


def _attribute(obj: Any, name: str) -> Any:
    return getattr(obj, name, None)


def _model_extra(obj: Any) -> dict[str, Any]:
    return getattr(obj, "model_extra", None) or {}


def _itself(obj: Any) -> Any:
    return obj


_LOGPROB_KEY = operator.itemgetter("logprob")


def _json_default(obj: Any) -> Any:
    dump = getattr(obj, "model_dump", None)  # pydantic / openai objects in user messages
    if callable(dump):
        return dump(mode="json", exclude_none=True)
    return repr(obj)


def _dumps(value: Any) -> str:
    return orjson.dumps(value, default=_json_default).decode()


class _Choice:
    """What one response choice says (from a full response, or accumulated from stream chunks)."""

    __slots__ = ("content", "tool_calls", "finish_reason", "token_ids", "logprobs", "has_ids")

    def __init__(self) -> None:
        self.content: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.has_ids = False


class CapturedCall:
    """One in-flight LLM exchange inside a rollout, and its span.

    ``request``: what the agent asked (a dict, as sent); ``extra``: the fields to add to it before it is
    sent. Responses and stream chunks are read as the openai client's objects, or with ``json=True`` as
    the engine's JSON itself (plain dicts: the gateway and the HTTP layer). One reader for both: only how
    a field is fetched differs (an attribute, or a key; vLLM's extra fields are ``model_extra`` there and
    plain keys here). ``inject=False``: add no token fields (the request is recorded as it was sent)."""

    # how a field of a response is fetched (openai's objects)
    _get = staticmethod(_attribute)
    _extra = staticmethod(_model_extra)
    _logprob = staticmethod(operator.attrgetter("logprob"))

    def __init__(self, server: Server, request: dict[str, Any], op: str, state: RolloutState, *, json: bool = False,
                 inject: bool = True) -> None:
        if json:  # the engine's JSON, as dicts
            self._get, self._extra, self._logprob = dict.get, _itself, _LOGPROB_KEY
        extra: dict[str, Any] = {}
        if state.sampling:  # the trainer's sampling settings win over the agent's (verl)
            extra.update({k: v for k, v in state.sampling.items() if v is not None})
        self.canary = tracing.canary(state.mode, state.rollout_id, request.get("model"))
        if self.canary is not None:  # a production call on canary: sent to the candidate's name (canary.py)
            extra["model"] = self.canary.candidate
            self.served_as = None
        else:  # the live version's own name on every replica (trainer_bridge/replicas.py), stamped with it
            self.served_as = tracing.served_as(request.get("model"))
        asked = request.get("model")
        if self.served_as is not None:
            extra["model"] = self.served_as[0]
        # the answer names the model asked for, not the one it was sent as (_as_asked)
        self._renamed = (extra["model"], asked) if extra.get("model") not in (None, asked) else None
        request = {**request, **extra} if extra else request
        self.server = server.key
        self.injected: tuple[str, ...] = ()
        self.asked_for_ids = bool(request.get("return_token_ids"))  # by the caller itself
        settings = tracing.settings
        if inject and not server.hosted and takes_token_fields.get(self.server) is not False:
            injected = []
            if settings.capture_token_ids and "return_token_ids" not in request:
                extra["return_token_ids"] = True
                injected.append("return_token_ids")
            if settings.capture_logprobs and request.get("logprobs") is None:
                extra["logprobs"] = True if op == semconv.OP_CHAT else 0
                injected.append("logprobs")
            self.injected = tuple(injected)
        self.extra = extra
        self.state = state
        self.op = op
        self._finishing = threading.RLock()
        self.index = state.next_llm_call()
        hint = _llm_hint.get()
        self.agent = (hint.agent if hint is not None else None) or current_agent_name()
        # the name asked for (samples are routed to policies by it); a versioned name answers (response model)
        self.model = asked if self.served_as is not None else request.get("model")
        self.version = (self.canary.version if self.canary is not None else self.served_as[1]
                        if self.served_as is not None else tracing.policy_version(self.model))
        self.done = False
        self.streamed = False
        self.read_as_bytes = False  # the answer was read from its bytes (read_answer_bytes), not from objects
        self.choices: dict[int, _Choice] = {}
        self.prompt_ids: list[int] | None = None
        self.response_meta: dict[str, Any] = {}
        if op == semconv.OP_CHAT:
            messages = request.get("messages") or []
        else:
            messages = [{"role": "prompt", "content": request.get("prompt")}]
        attributes: dict[str, Any] = {
            semconv.GEN_AI_OPERATION_NAME: op,
            semconv.GEN_AI_PROVIDER_NAME: "openai",
            semconv.ROLLOUT_ID: state.rollout_id,
            semconv.LLM_CALL_INDEX: self.index,
            semconv.POLICY_VERSION: state.call_version(self.version),
            semconv.GEN_AI_INPUT_MESSAGES: _dumps(messages),
        }
        if self.model is not None:
            attributes[semconv.GEN_AI_REQUEST_MODEL] = str(self.model)
        if self.agent is not None:
            attributes[semconv.GEN_AI_AGENT_NAME] = self.agent
        present = _SAMPLING_ORDER.keys() & request.keys()
        sampling = {k: request[k] for k in sorted(present, key=_SAMPLING_ORDER.__getitem__)
                    if request[k] is not None} if present else {}
        guided = guided_decoding(request)
        if guided:
            sampling["guided"] = guided
        attributes[semconv.SAMPLING_PARAMS] = _dumps(sampling)
        for key, attr in _NUMERIC_REQUEST_ATTRIBUTES:
            value = sampling.get(key)
            if value is not None and type(value) in (int, float):
                attributes[attr] = value
        if request.get("tools"):
            attributes[semconv.GEN_AI_TOOL_DEFINITIONS] = _dumps(request["tools"])
        if server.host:
            attributes[semconv.SERVER_ADDRESS] = server.host
            if server.port:
                attributes[semconv.SERVER_PORT] = server.port
        if hint is not None:
            hint.recorded += 1
            if hint.framework_run_id is not None:
                attributes[semconv.FRAMEWORK_RUN_ID] = hint.framework_run_id
        self.span = tracing.tracer.start_span(
            f"{op} {self.model}", kind=SpanKind.CLIENT, attributes=attributes,
            context=parent_context(hint.parent if hint is not None else None),
        )
        state.open_calls[self.index] = self

    # -- full responses ----------------------------------------------------------------------------
    def record_response(self, resp: Any) -> None:
        if not self.read_as_bytes:
            self.read_response(resp)
        self.finish()

    def fail(self, error: BaseException) -> None:
        """The request raised. Errors that carry the completion (openai's LengthFinishReasonError
        when parsing a truncated structured output) still have the engine's tokens: keep them."""
        completion = getattr(error, "completion", None)
        if completion is not None and hasattr(completion, "choices") and not self.read_as_bytes:
            self.read_response(completion)
        self.finish(error=error)

    def read_answer_bytes(self, raw: bytes) -> bytes | None:
        """Read a whole answer from the engine's bytes, before a client parses them (issue 46): the ids
        and log-probs come from orjson's lists, and the client gets the answer less the token fields it
        did not ask for (returned; None: leave the answer as it is, it is read from the client's objects).
        Without this the openai client builds an object per log-prob it never asked for (a traced call at
        4,000+1,000 tokens added 2.2-3.1 ms before, 0.85-1.09 ms after: docs/benchmarks.md section 7)."""
        if not self.injected or self.done:
            return None
        with gc_paused():  # the parsed answer is dropped inside: what it made is freed, never collected
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:  # what orjson refuses (a NaN) the client's parser may take: read there
                count("llm_answers_read_from_client_objects")
                return None
            if type(data) is not dict or not isinstance(data.get("choices"), list):
                return None
            self._get, self._extra, self._logprob = dict.get, _itself, _LOGPROB_KEY
            self.read_as_bytes = True
            self.read_response(data)
            out = orjson.dumps(strip(data, self.injected))
            del data
        return out

    def read_response(self, resp: Any) -> None:
        get, extra = self._get, self._extra
        try:
            self.prompt_ids = extra(resp).get("prompt_token_ids")
            for choice in get(resp, "choices") or ():
                c = self.choices.setdefault(get(choice, "index") or 0, _Choice())
                cextra = extra(choice)
                if self.prompt_ids is None and cextra.get("prompt_token_ids") is not None:
                    self.prompt_ids = cextra["prompt_token_ids"]  # /completions puts them in the choice
                ids = cextra.get("token_ids")
                if ids is not None:
                    c.token_ids, c.has_ids = list(ids), True
                c.finish_reason = get(choice, "finish_reason")
                message = get(choice, "message")
                lp = get(choice, "logprobs")
                if message is not None:
                    c.content = [get(message, "content") or ""]
                    for i, tc in enumerate(get(message, "tool_calls") or ()):
                        fn = get(tc, "function")
                        c.tool_calls[i] = {
                            "id": get(tc, "id"), "type": "function",
                            "function": {"name": (get(fn, "name") if fn is not None else None) or "",
                                         "arguments": (get(fn, "arguments") if fn is not None else None) or ""},
                        }
                    if lp is not None and (content := get(lp, "content")):
                        c.logprobs = list(map(self._logprob, content))
                else:
                    c.content = [get(choice, "text") or ""]
                    if lp is not None and (values := get(lp, "token_logprobs")):
                        c.logprobs = [x if x is not None else 0.0 for x in values]
            self._meta_from(resp)
            self._as_asked(resp)
            usage = get(resp, "usage")
            if usage is not None:
                self.response_meta["usage"] = usage
        except Exception as exc:
            report_failure("reading an LLM response", exc)

    def _meta_from(self, obj: Any) -> None:
        if "id" not in self.response_meta and (response_id := self._get(obj, "id")):
            self.response_meta["id"] = response_id
            self.response_meta["model"] = self._get(obj, "model")

    def _as_asked(self, obj: Any) -> None:
        """An answer (or chunk) from the name a call was sent as (the live version's own ``policy@vk``, a
        canary's candidate) names the model the agent asked for, as if sent as asked: agents compare the
        two (AutoGen warns on every call). The span's ``gen_ai.response.model`` keeps the name that answered."""
        if self._renamed is None or self._get(obj, "model") != self._renamed[0]:
            return
        if isinstance(obj, dict):
            obj["model"] = self._renamed[1]
        else:
            with contextlib.suppress(Exception):  # an object that refuses it keeps the served name
                obj.model = self._renamed[1]

    # -- streams -----------------------------------------------------------------------------------
    def on_chunk(self, chunk: Any) -> None:
        get, extra = self._get, self._extra
        try:
            self._meta_from(chunk)
            self._as_asked(chunk)
            if self.prompt_ids is None:
                self.prompt_ids = extra(chunk).get("prompt_token_ids")
            usage = get(chunk, "usage")
            if usage is not None:
                self.response_meta["usage"] = usage
            for choice in get(chunk, "choices") or ():
                c = self.choices.setdefault(get(choice, "index") or 0, _Choice())
                cextra = extra(choice)
                if self.prompt_ids is None and cextra.get("prompt_token_ids") is not None:
                    self.prompt_ids = cextra["prompt_token_ids"]
                ids = cextra.get("token_ids")
                if ids:
                    c.token_ids.extend(ids)
                    c.has_ids = True
                elif ids is not None:
                    c.has_ids = True
                if finish_reason := get(choice, "finish_reason"):
                    c.finish_reason = finish_reason
                delta = get(choice, "delta")
                lp = get(choice, "logprobs")
                if delta is not None:
                    if content := get(delta, "content"):
                        c.content.append(content)
                    for tc in get(delta, "tool_calls") or ():
                        slot = c.tool_calls.setdefault(
                            get(tc, "index"), {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                        )
                        if call_id := get(tc, "id"):
                            slot["id"] = call_id
                        fn = get(tc, "function")
                        if fn is not None:
                            slot["function"]["name"] += get(fn, "name") or ""
                            slot["function"]["arguments"] += get(fn, "arguments") or ""
                    if lp is not None and (content := get(lp, "content")):
                        c.logprobs.extend(map(self._logprob, content))
                else:
                    if text := get(choice, "text"):
                        c.content.append(text)
                    if lp is not None and (values := get(lp, "token_logprobs")):
                        c.logprobs.extend(x if x is not None else 0.0 for x in values)
        except Exception as exc:
            report_failure("reading a streamed LLM chunk", exc)

    # -- the end -----------------------------------------------------------------------------------
    def _choice_attributes(self, c: _Choice) -> tuple[dict[str, Any], PackedTokens | None]:
        """The span attributes of one choice, and its token arrays (packed once; they go to the store
        beside the span, not through OpenTelemetry's per-element attribute checks)."""
        message: dict[str, Any] = {"role": "assistant", "content": "".join(c.content)}
        if c.tool_calls:
            message["tool_calls"] = [c.tool_calls[i] for i in sorted(c.tool_calls)]
        attrs: dict[str, Any] = {semconv.GEN_AI_OUTPUT_MESSAGES: _dumps([message])}
        if c.finish_reason:
            attrs[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = (c.finish_reason,)
        tokens = None
        if c.has_ids and self.prompt_ids is not None:
            takes_token_fields[self.server] = True
            try:
                tokens = PackedTokens.of(self.prompt_ids, c.token_ids, c.logprobs or None)
            except (OverflowError, TypeError) as exc:
                report_failure("packing token ids", exc)
        if tokens is not None:
            attrs[semconv.TOKEN_IDS_SOURCE] = semconv.SOURCE_ENGINE
        else:
            attrs[semconv.TOKEN_IDS_SOURCE] = semconv.SOURCE_MISSING
            count("llm_calls_without_token_ids")
            if self.injected or self.asked_for_ids:
                report_failure(
                    "token id capture",
                    message="lightning-rl: an LLM call returned no token ids; it is recorded with "
                    "token_ids.source=missing and left out of training samples (serve with vLLM >= 0.10.2, "
                    "which honours return_token_ids)",
                )
            else:
                report_failure("token ids not asked for", message=(
                    "lightning-rl: an LLM call was recorded without token ids because its request did not ask for "
                    "them (return_token_ids was not sent: capture is off for this host or this call bypassed the "
                    "openai client); it is left out of training samples"))
        return attrs, tokens

    def finish(self, *, incomplete: bool = False, error: BaseException | None = None) -> None:
        # Once, under the call's lock; it leaves the rollout's open calls only once its span has ended, so that a
        # rollout ending meanwhile on another thread (the gateway's, a stream's reader) finds it there and waits
        # here, instead of being stored without it.
        with self._finishing:
            if self.done:
                return
            self.done = True
            try:
                self._finish(incomplete, error)
            finally:
                self.state.open_calls.pop(self.index, None)

    def _finish(self, incomplete: bool, error: BaseException | None) -> None:
        try:
            meta = self.response_meta
            common: dict[str, Any] = {}
            if meta.get("id"):
                common[semconv.GEN_AI_RESPONSE_ID] = meta["id"]
            if meta.get("model"):
                common[semconv.GEN_AI_RESPONSE_MODEL] = meta["model"]
            usage = meta.get("usage")
            if usage is not None:
                common[semconv.GEN_AI_USAGE_INPUT_TOKENS] = self._get(usage, "prompt_tokens") or 0
                common[semconv.GEN_AI_USAGE_OUTPUT_TOKENS] = self._get(usage, "completion_tokens") or 0
            if incomplete:
                common[semconv.INCOMPLETE] = True
            if self.streamed:
                common[semconv.STREAMED] = True
            exact = self.canary is not None or self.served_as is not None  # sent to one version's own name
            version_end = self.version if exact else tracing.policy_version(self.model)
            if version_end != self.version:  # a publish landed while the call ran
                common[semconv.POLICY_VERSION_END] = version_end
            indices = sorted(self.choices) or [0]
            first = self.choices.get(indices[0]) or _Choice()
            span = self.span
            if error is None or self.choices:
                attrs, tokens = self._choice_attributes(first)
                span.set_attributes({**common, **attrs})
                if tokens is not None:
                    tracing.attach_tokens(span, tokens)
            else:
                span.set_attributes({**common, semconv.TOKEN_IDS_SOURCE: semconv.SOURCE_MISSING})
            if error is not None:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            span.end()
            self.state.llm_call_finished(self.index, self.agent)
            if first.tool_calls:  # a framework's tool hook without call ids finds them here
                self.state.note_tool_calls([(c["function"]["name"], c["function"]["arguments"], c["id"])
                                            for c in (first.tool_calls[i] for i in sorted(first.tool_calls)) if c["id"]],
                                           self.agent)
            for i in indices[1:]:  # n > 1: every further choice is an LLM call (and a sample) of its own
                self._extra_choice_span(common, self.choices[i], i)
        except Exception as exc:
            report_failure("recording an LLM call", exc)

    def _extra_choice_span(self, common: dict[str, Any], choice: _Choice, i: int) -> None:
        index = self.state.next_llm_call()
        attrs = dict(self.span.attributes)
        attrs.update(common)
        choice_attrs, tokens = self._choice_attributes(choice)
        attrs.update(choice_attrs)
        attrs[semconv.LLM_CALL_INDEX] = index
        attrs[semconv.CHOICE_INDEX] = i
        span = tracing.tracer.start_span(
            self.span.name, kind=SpanKind.CLIENT, attributes=attrs, start_time=self.span.start_time
        )
        if tokens is not None:
            tracing.attach_tokens(span, tokens)
        span.end()
        self.state.llm_call_finished(index, self.agent)
