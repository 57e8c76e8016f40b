"""The OpenAI Python client adapter: the one place where LLM calls and engine token ids are captured.

``instrument()`` (called when lightning_rl is imported) wraps ``SyncAPIClient.request`` and
``AsyncAPIClient.request``, the method every endpoint goes through (plain calls,
``with_raw_response``, ``with_streaming_response``, streaming), so LangChain, AutoGen and plain code
are all seen. Outside a rollout the wrapper only checks a contextvar and calls through.

Inside a rollout, each ``/chat/completions`` or ``/completions`` request becomes a GenAI span
(``chat {model}``, kind CLIENT) with the request and response messages, tool calls, and vLLM's
``prompt_token_ids``, ``token_ids`` and logprobs. The request gets ``return_token_ids: true`` and
``logprobs`` unless the caller set them or capture is switched off (``configure(capture_token_ids=
False)``, ``LIGHTNING_RL_CAPTURE_TOKEN_IDS=0``). Which servers get them:

* never api.openai.com, nor the hosts in ``LIGHTNING_RL_NO_INJECT_HOSTS``;
* a server that answered with token ids is known to take them;
* any other server gets them on its first call; if it refuses that request (400 or 422) naming one of
  them (or saying it refuses fields it does not know), the same request is sent once more without
  them, the server is remembered as one that does not take them, and the fallback is counted
  (``llm_requests_resent_without_token_fields``) and logged once. Any other refusal (a context-length
  error) goes back to the agent after one request.

Where the server returns no ids the call is still recorded with ``token_ids.source = missing``.
``/responses`` calls are not recorded: they are counted (``llm_calls_unrecorded_responses_api``)
and logged once. Nothing here raises into the caller: failures are logged once per cause and counted.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any

import orjson
from opentelemetry.trace import SpanKind, Status, StatusCode

from .. import semconv
from ..diagnostics import count, report_failure
from ..records import PackedTokens
from ..tracer.context import RolloutState, _llm_hint, _rollout, current_agent_name
from ..tracer.provider import parent_context, tracing
from .http_clients import instrumented_request

_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "seed", "n",
    "stop", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "top_logprobs",
)
_NUMERIC_REQUEST_ATTRIBUTES = (
    ("temperature", semconv.GEN_AI_REQUEST_TEMPERATURE), ("top_p", semconv.GEN_AI_REQUEST_TOP_P),
    ("seed", semconv.GEN_AI_REQUEST_SEED), ("max_tokens", semconv.GEN_AI_REQUEST_MAX_TOKENS),
    ("max_completion_tokens", semconv.GEN_AI_REQUEST_MAX_TOKENS),
)


def _attribute(obj: Any, name: str) -> Any:
    return getattr(obj, name, None)


def _model_extra(obj: Any) -> dict[str, Any]:
    return getattr(obj, "model_extra", None) or {}


def _itself(obj: Any) -> Any:
    return obj
_NO_INJECT_HOSTS = frozenset({"api.openai.com"})
# "host:port" -> True (answered with token ids) / False (refused the fields); absent: not known yet
_takes_token_fields: dict[str, bool] = {}


def _json_default(obj: Any) -> Any:
    dump = getattr(obj, "model_dump", None)  # pydantic / openai objects in user messages
    if callable(dump):
        return dump(mode="json", exclude_none=True)
    return repr(obj)


def _dumps(value: Any) -> str:
    return orjson.dumps(value, default=_json_default).decode()


def _endpoint(options: Any) -> str | None:
    if options.method.lower() != "post":
        return None
    url = options.url
    if url.endswith("/chat/completions"):
        return semconv.OP_CHAT
    if url.endswith("/completions"):
        return semconv.OP_TEXT_COMPLETION
    if url.endswith("/responses"):
        count("llm_calls_unrecorded_responses_api")
        report_failure("responses api", message=(
            "lightning-rl: a /responses call inside a rollout is not recorded (no span, no token ids); "
            "use chat.completions for the calls you want to train on"))
    return None


def _server_key(base_url: Any) -> str:
    return f"{getattr(base_url, 'host', None)}:{getattr(base_url, 'port', None)}"


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


class LLMCall:
    """One in-flight LLM request inside a rollout, and its span.

    Responses and stream chunks are read as the openai client's objects, or with ``json=True`` as the
    engine's JSON itself (plain dicts: the gateway, which never builds the client's models). One reader
    for both: only how a field is fetched differs (an attribute, or a key; vLLM's extra fields are
    ``model_extra`` there and plain keys here)."""

    # how a field of a response is fetched (openai's objects)
    _get = staticmethod(_attribute)
    _extra = staticmethod(_model_extra)
    _logprob = staticmethod(operator.attrgetter("logprob"))

    def __init__(self, client: Any, options: Any, op: str, state: RolloutState, *, json: bool = False,
                 inject: bool = True) -> None:
        if json:  # the engine's JSON, as dicts
            self._get, self._extra, self._logprob = dict.get, _itself, operator.itemgetter("logprob")
        body = options.json_data if isinstance(options.json_data, dict) else {}
        extra = dict(options.extra_json) if options.extra_json else {}
        if state.sampling:  # the trainer's sampling settings win over the agent's (verl)
            extra.update({k: v for k, v in state.sampling.items() if v is not None})
            options.extra_json = extra
        request = {**body, **extra} if extra else body
        base_url = getattr(client, "base_url", None)
        host = getattr(base_url, "host", None)
        self.server = _server_key(base_url)
        self.injected: tuple[str, ...] = ()
        self.asked_for_ids = bool(request.get("return_token_ids"))  # by the caller itself
        settings = tracing.settings
        if (inject and host not in _NO_INJECT_HOSTS and host not in settings.no_inject_hosts
                and _takes_token_fields.get(self.server) is not False):
            injected = []
            if settings.capture_token_ids and "return_token_ids" not in request:
                extra["return_token_ids"] = True
                injected.append("return_token_ids")
            if settings.capture_logprobs and request.get("logprobs") is None:
                extra["logprobs"] = True if op == semconv.OP_CHAT else 0
                injected.append("logprobs")
            if injected:
                # The client builds these options for this one call (and copies them again before any
                # retry), so setting the field in place is safe and avoids a pydantic copy per call.
                options.extra_json = extra
                self.injected = tuple(injected)
        self.options = options
        self.state = state
        self.op = op
        self.index = state.next_llm_call()
        hint = _llm_hint.get()
        self.agent = (hint.agent if hint is not None else None) or current_agent_name()
        self.model = request.get("model")
        self.version = tracing.policy_version(self.model)
        self.done = False
        self.streamed = False
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
        sampling = {k: v for k in _SAMPLING_KEYS if (v := request.get(k)) is not None}
        attributes[semconv.SAMPLING_PARAMS] = _dumps(sampling)
        for key, attr in _NUMERIC_REQUEST_ATTRIBUTES:
            value = sampling.get(key)
            if value is not None and type(value) in (int, float):
                attributes[attr] = value
        if request.get("tools"):
            attributes[semconv.GEN_AI_TOOL_DEFINITIONS] = _dumps(request["tools"])
        if host:
            attributes[semconv.SERVER_ADDRESS] = host
            port = getattr(base_url, "port", None)
            if port:
                attributes[semconv.SERVER_PORT] = port
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
        self.read_response(resp)
        self.finish()

    def fail(self, error: BaseException) -> None:
        """The request raised. Errors that carry the completion (openai's LengthFinishReasonError
        when parsing a truncated structured output) still have the engine's tokens: keep them."""
        completion = getattr(error, "completion", None)
        if completion is not None and hasattr(completion, "choices"):
            self.read_response(completion)
        self.finish(error=error)

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
            usage = get(resp, "usage")
            if usage is not None:
                self.response_meta["usage"] = usage
        except Exception as exc:
            report_failure("reading an LLM response", exc)

    def _meta_from(self, obj: Any) -> None:
        if "id" not in self.response_meta and (response_id := self._get(obj, "id")):
            self.response_meta["id"] = response_id
            self.response_meta["model"] = self._get(obj, "model")

    # -- streams -----------------------------------------------------------------------------------
    def on_chunk(self, chunk: Any) -> None:
        get, extra = self._get, self._extra
        try:
            self._meta_from(chunk)
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
            _takes_token_fields[self.server] = True
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
        if self.done:
            return
        self.done = True
        self.state.open_calls.pop(self.index, None)
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
            version_end = tracing.policy_version(self.model)
            if version_end != self.version:  # a publish landed while the call ran
                common[semconv.POLICY_VERSION_END] = version_end
            indices = sorted(self.choices) or [0]
            first = self.choices.get(indices[0], _Choice())
            span = self.span
            if error is None or self.choices:
                attrs, tokens = self._choice_attributes(first)
                span.set_attributes({**common, **attrs})
                if tokens is not None:
                    tracing.processor.attach_tokens(span, tokens)
            else:
                span.set_attributes({**common, semconv.TOKEN_IDS_SOURCE: semconv.SOURCE_MISSING})
            if error is not None:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
            span.end()
            self.state.llm_call_finished(self.index, self.agent)
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
            tracing.processor.attach_tokens(span, tokens)
        span.end()
        self.state.llm_call_finished(index, self.agent)


# -- attaching to whatever the client returns ----------------------------------------------------

def _wrap_sync_stream(stream: Any, call: LLMCall) -> Any:
    inner = stream._iterator

    def iterate():
        try:
            for chunk in inner:
                call.on_chunk(chunk)
                yield chunk
        except GeneratorExit:
            call.finish(incomplete=True)
            raise
        except BaseException as exc:
            call.finish(incomplete=True, error=exc)
            raise
        call.finish()

    call.streamed = True
    stream._iterator = iterate()
    return stream


def _wrap_async_stream(stream: Any, call: LLMCall) -> Any:
    inner = stream._iterator

    async def iterate():
        try:
            async for chunk in inner:
                call.on_chunk(chunk)
                yield chunk
        except GeneratorExit:
            call.finish(incomplete=True)
            raise
        except BaseException as exc:
            call.finish(incomplete=True, error=exc)
            raise
        call.finish()

    call.streamed = True
    stream._iterator = iterate()
    return stream


def _attach(result: Any, call: LLMCall) -> Any:
    """Record ``result`` (a response, a stream, or a raw response) into ``call``. Never raises."""
    try:
        from openai import AsyncStream, Stream

        if isinstance(result, Stream):
            return _wrap_sync_stream(result, call)
        if isinstance(result, AsyncStream):
            return _wrap_async_stream(result, call)
        parse = getattr(result, "parse", None)
        if callable(parse) and not hasattr(result, "choices"):  # with_raw_response / with_streaming_response
            if inspect.iscoroutinefunction(parse):

                @functools.wraps(parse)
                async def parse_async(*args: Any, **kwargs: Any) -> Any:
                    try:
                        parsed = await parse(*args, **kwargs)
                    except BaseException as exc:
                        call.fail(exc)
                        raise
                    return _attach_parsed(parsed, call)

                result.parse = parse_async
            else:

                @functools.wraps(parse)
                def parse_sync(*args: Any, **kwargs: Any) -> Any:
                    try:
                        parsed = parse(*args, **kwargs)
                    except BaseException as exc:
                        call.fail(exc)
                        raise
                    return _attach_parsed(parsed, call)

                result.parse = parse_sync
            return result
        if hasattr(result, "choices"):
            call.record_response(result)
        else:
            report_failure("unknown LLM response type", message=f"lightning-rl: cannot read an LLM response of type {type(result).__name__}; the call is recorded without a response")
            call.finish(incomplete=True)
    except Exception as exc:
        report_failure("attaching to an LLM response", exc)
        call.finish(incomplete=True)
    return result


def _attach_parsed(parsed: Any, call: LLMCall) -> Any:
    if call.done or call.streamed:
        return parsed
    return _attach(parsed, call)


#: How servers say they refuse a request field they do not know (besides naming it): pydantic's
#: "extra inputs are not permitted" (vLLM, FastAPI servers), OpenAI's "unrecognized request argument".
_UNKNOWN_FIELD_WORDS = ("extra inputs are not permitted", "extra_forbidden", "unrecognized request argument",
                        "unknown field", "unknown parameter", "unexpected keyword", "additional properties")


def _refuses_token_fields(error: BaseException, injected: tuple[str, ...]) -> bool:
    """Whether a 400/422 is about the fields we added: its text names one, or says it refuses unknown
    fields. Any other refusal (a context-length error, a bad message) is the agent's, sent once."""
    body = getattr(error, "body", None)
    text = f"{error} {body if body is not None else ''}".lower()
    return any(field in text for field in injected) or any(words in text for words in _UNKNOWN_FIELD_WORDS)


def _resend_without_token_fields(call: LLMCall, error: BaseException) -> bool:
    """Whether to send the request once more without the fields we added: the server refused it
    (400/422) because of them, and it is not known to take them."""
    if not call.injected or _takes_token_fields.get(call.server) is not None:
        return False
    if getattr(error, "status_code", None) not in (400, 422):
        return False
    if not _refuses_token_fields(error, call.injected):
        count("llm_requests_refused_not_for_token_fields")  # the agent's own error: answered after one request
        return False
    extra = {k: v for k, v in (call.options.extra_json or {}).items() if k not in call.injected}
    call.options.extra_json = extra or None
    call.injected = ()
    return True


def _refused_token_fields(call: LLMCall) -> None:
    _takes_token_fields[call.server] = False
    count("llm_requests_resent_without_token_fields")
    report_failure(f"token fields refused by {call.server}", message=(
        f"lightning-rl: the server at {call.server} refused return_token_ids/logprobs (HTTP 400/422); the "
        "request was sent again without them, and calls to it are recorded without token ids (not trained on). "
        "Serve the model with vLLM >= 0.10.2 to train on these calls, or list the host in "
        "LIGHTNING_RL_NO_INJECT_HOSTS to skip the first try"))


def _start(client: Any, options: Any) -> LLMCall | None:
    state = _rollout.get()
    if state is None:
        return None
    try:
        op = _endpoint(options)
        return LLMCall(client, options, op, state) if op is not None else None
    except Exception as exc:
        report_failure("starting an LLM call span", exc)
        return None


def _wrap_sync(original: Any) -> Any:
    @functools.wraps(original)
    def request(self: Any, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is None:
            return original(self, cast_to, options, *args, **kwargs)
        mark = instrumented_request.set(True)  # the HTTP layer leaves this request to us
        try:
            return _request_sync(original, self, cast_to, options, args, kwargs)
        finally:
            instrumented_request.reset(mark)

    request.__lightning_rl_original__ = original
    return request


def _request_sync(original: Any, self: Any, cast_to: Any, options: Any, args: tuple, kwargs: dict) -> Any:
    call = _start(self, options)
    if call is None:
        return original(self, cast_to, options, *args, **kwargs)
    try:
        try:
            result = original(self, cast_to, call.options, *args, **kwargs)
        except Exception as exc:
            if not _resend_without_token_fields(call, exc):
                raise
            result = original(self, cast_to, call.options, *args, **kwargs)
            _refused_token_fields(call)
    except BaseException as exc:
        call.fail(exc)
        raise
    return _attach(result, call)


def _wrap_async(original: Any) -> Any:
    @functools.wraps(original)
    async def request(self: Any, cast_to: Any, options: Any, *args: Any, **kwargs: Any) -> Any:
        if _rollout.get() is None:
            return await original(self, cast_to, options, *args, **kwargs)
        mark = instrumented_request.set(True)  # the HTTP layer leaves this request to us
        try:
            return await _request_async(original, self, cast_to, options, args, kwargs)
        finally:
            instrumented_request.reset(mark)

    request.__lightning_rl_original__ = original
    return request


async def _request_async(original: Any, self: Any, cast_to: Any, options: Any, args: tuple, kwargs: dict) -> Any:
    call = _start(self, options)
    if call is None:
        return await original(self, cast_to, options, *args, **kwargs)
    try:
        try:
            result = await original(self, cast_to, call.options, *args, **kwargs)
        except Exception as exc:
            if not _resend_without_token_fields(call, exc):
                raise
            result = await original(self, cast_to, call.options, *args, **kwargs)
            _refused_token_fields(call)
    except BaseException as exc:
        call.fail(exc)
        raise
    return _attach(result, call)


def instrument() -> bool:
    """Wrap the OpenAI client's request methods (idempotent). Returns False if openai is missing."""
    try:
        from openai._base_client import AsyncAPIClient, SyncAPIClient
    except ImportError:
        return False
    if not hasattr(SyncAPIClient.request, "__lightning_rl_original__"):
        SyncAPIClient.request = _wrap_sync(SyncAPIClient.request)
    if not hasattr(AsyncAPIClient.request, "__lightning_rl_original__"):
        AsyncAPIClient.request = _wrap_async(AsyncAPIClient.request)
    return True


def uninstrument() -> None:
    from openai._base_client import AsyncAPIClient, SyncAPIClient

    for cls in (SyncAPIClient, AsyncAPIClient):
        original = getattr(cls.request, "__lightning_rl_original__", None)
        if original is not None:
            cls.request = original
