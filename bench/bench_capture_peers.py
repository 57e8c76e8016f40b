#!/usr/bin/env python
"""The CPU that capturing one LLM call adds, for several contenders side by side in one run (issue 57).

Every contender runs in a worker process of its own and makes chat completions through openai's own client
(``openai.OpenAI``) against an upstream that answers as vLLM does (``bench_capture_cost.vllm_body``: token ids
and log-probs only when the request asks for them; 9 answers in turn). The driver runs the rounds: in round r
every contender runs one block of N untraced calls and one block of N captured calls (untraced first in even
rounds, captured first in odd ones; the contenders take turns, one at a time, the others idle). A block's
figure is the CPU time of the whole worker process (``time.process_time()``: all its threads) per call
(``_common.cpu_rounds``), and what capture adds is the median over rounds of (captured - untraced) / N. Whatever
exports or writes in the background is flushed inside the captured block (``provider.force_flush()``,
``store.flush()``), so its work is timed there.

Contenders (``--contenders``):

* ``otel-openai-v2``: the official OpenTelemetry GenAI instrumentation of the openai client
  (opentelemetry-instrumentation-openai-v2, ``OpenAIInstrumentor().instrument(tracer_provider=...)``) into an SDK
  ``TracerProvider`` with a ``BatchSpanProcessor`` whose exporter counts the spans and keeps the last one (no
  meter or logger provider: their no-op defaults). Untraced: the same client method unwrapped (``__wrapped__``).
  Without message content (the default).
* ``otel-openai-v2-content``: the same with ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY``
  (util-genai 1.x refuses ``true`` with a warning and captures nothing).
* ``lightning-rl``: calls inside one ``@lrl.trace`` rollout into a durable SQLite store (as
  bench_capture_cost.py does); untraced calls run in an empty ``contextvars.Context()``.
* ``lightning-rl-py312``: the same, under the Python 3.12 of ``--agl-python`` (lightning-rl installed there).
* ``agent-lightning``: Agent Lightning 1.0.2, which records token ids and log-probs only in its server's LLM proxy
  (``POST /proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/train/openai/v1/chat/completions``, into the
  server's in-memory event store). Its server runs as shipped (``python -m agentlightning.server``, uvicorn, its
  access log on) under ``--agl-python`` (``make venv-agl``), the upstream is a local HTTP server answering the same
  vLLM bytes in a process of its own (not measured). Captured: the client calls the proxy; untraced: the same
  client kind calls the upstream directly. A block's figure is the client process's CPU plus the server process's
  (``/proc/<pid>/task/*/schedstat``, nanoseconds, all its threads), read at both ends of both blocks.
* ``floor``: what capture cannot avoid, timed alone, without any client: parsing the fields tracing adds to the
  answer and writing one packed row per call durably. Captured: ``orjson.loads`` of the answer with the token
  fields (with the garbage collector held off, as the capture parses an answer since issue 57:
  ``capture.gc_paused``), its ids and log-probs packed as lightning-rl packs them (``PackedTokens.of``: int32 ids,
  float32 log-probs), and one row per call (rollout id, seq, the three blobs) inserted into SQLite in WAL mode with
  ``synchronous=NORMAL`` (lightning-rl's default), one transaction per block (as the store's writer commits a
  flush); untraced: ``orjson.loads`` of the answer without them. It does not depend on the client: measured once
  per shape, shown under the first client.

Clients (``--clients``): ``default`` is ``openai.OpenAI()`` with no ``http_client``: the client it builds itself
(in openai 3.x an httpx2 ``Client`` with an ``httpx2.HTTPTransport``) with that transport replaced by an
``httpx2.MockTransport`` answering in the same process; ``httpx`` is a legacy ``httpx.Client`` with an
``httpx.MockTransport`` passed as ``http_client``. For agent-lightning both go over real sockets (the proxy is a
server): the default client as built, and a plain ``httpx.Client()``.

Every contender is checked after its rounds, and a figure counts only when the check passes: the spans exported
(one per captured call, none for the untraced ones; message content present with ``SPAN_ONLY``, absent without);
lightning-rl's stored calls (every one, the last with the prompt's and response's token ids and log-probs of the
answer it got, read back from the store); Agent Lightning's ``model_request`` events (every one, the last read back
through its triplet query with the answer's ids and log-probs); the floor's rows read back.

Run: .venv/bin/python bench/bench_capture_peers.py [--shapes 40+4,512+128,4000+1000] [--rounds 41]
     [--calls N] [--clients default,httpx] [--contenders ...] [--agl-python .venv-agl/bin/python] [--json-out PATH]
(``make venv-agl`` builds .venv-agl; the otel contenders need opentelemetry-instrumentation-openai-v2==2.4b0 and
opentelemetry-util-genai==1.1b0 in the driver's environment.)
"""

from __future__ import annotations

import argparse
import contextvars
import json
import os
import pickle
import platform
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from _common import cpu_rounds, summary  # noqa: E402  (stdlib only: the workers import it too)

CONTENDERS = ("otel-openai-v2", "otel-openai-v2-content", "lightning-rl", "lightning-rl-py312", "agent-lightning",
              "floor")
CLIENTS = ("default", "httpx")
AGL_CONTENDERS = ("lightning-rl-py312", "agent-lightning")  # run under --agl-python
MESSAGES = [{"role": "system", "content": "You are a helpful agent."}, {"role": "user", "content": "What is 12+30?"}]
BASE_URL = "http://vllm.local:8000/v1"
CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
REPLY_TIMEOUT = 900.0  # seconds a worker may take for one command (set-up, a round, the check)


def calls_for(prompt: int, response: int) -> int:
    """Calls per block: about 10,000 tokens' worth, 5 to 200 (bench_capture_cost.py's rule)."""
    return max(5, min(200, 10_000 // (prompt + response)))


def versions(*names: str) -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


PACKAGES = ("openai", "httpx", "httpx2", "orjson", "pydantic", "opentelemetry-api", "opentelemetry-sdk",
            "opentelemetry-instrumentation-openai-v2", "opentelemetry-util-genai", "lightning-rl", "agentlightning",
            "fastapi", "uvicorn", "starlette", "httptools", "uvloop")


# ---------------------------------------------------------------------------------------------------------------
# The upstream: answers as vLLM does, in process (a mock transport) or as a local HTTP server
# ---------------------------------------------------------------------------------------------------------------

def load_bodies(path: str) -> dict[tuple[bool, bool], list[bytes]]:
    with open(path, "rb") as f:
        return pickle.load(f)


def asked(content: bytes, loads: Callable[[bytes], Any]) -> tuple[bool, bool]:
    sent = loads(content) if content else {}
    return bool(sent.get("return_token_ids")), bool(sent.get("logprobs"))


def mock_handler(module: Any, bodies: dict[tuple[bool, bool], list[bytes]]) -> Callable[[Any], Any]:
    """An httpx/httpx2 MockTransport handler answering each request as vLLM would (bench_capture_cost.answers,
    for either module)."""
    import orjson

    turn = [0]
    n = len(bodies[(True, True)])

    def answer(request: Any) -> Any:
        turn[0] += 1
        return module.Response(200, content=bodies[asked(request.content, orjson.loads)][turn[0] % n],
                               headers={"content-type": "application/json"})

    return answer


def serve_fake_vllm(bodies_path: str) -> None:
    """A local HTTP/1.1 server (keep-alive) answering POSTs with the vLLM bytes; prints its port."""
    import asyncio

    try:
        import orjson

        loads: Callable[[bytes], Any] = orjson.loads
    except ImportError:
        loads = json.loads
    bodies = load_bodies(bodies_path)
    n = len(bodies[(True, True)])
    turn = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                length, close = 0, False
                for line in head.split(b"\r\n")[1:]:
                    key, _, value = line.partition(b":")
                    key = key.strip().lower()
                    if key == b"content-length":
                        length = int(value)
                    elif key == b"connection" and value.strip().lower() == b"close":
                        close = True
                content = await reader.readexactly(length) if length else b""
                if head.startswith(b"GET"):
                    body = b'{"object":"list","data":[{"id":"tiny","object":"model"}]}'
                else:
                    turn[0] += 1
                    body = bodies[asked(content, loads)][turn[0] % n]
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                             % len(body) + body)
                await writer.drain()
                if close:
                    return
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=256)
        print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------------------------
# Workers: one contender, one shape, one client; commands on stdin, one JSON line per reply
# ---------------------------------------------------------------------------------------------------------------

def openai_client(kind: str, bodies: dict | None, base_url: str = BASE_URL) -> tuple[Any, str]:
    """An openai client of ``kind``, answered in process by a mock transport when ``bodies`` are given (else it
    goes over the network to ``base_url``), and the transport it uses."""
    import openai

    if kind == "default":
        client = openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
        built = client._client
        transport = f"{type(built).__module__}.{type(built).__name__} with {type(built._transport).__module__}." \
                    f"{type(built._transport).__name__}"
        if bodies is not None:
            import httpx2

            if built._mounts:
                raise RuntimeError(f"the default client has proxy mounts ({list(built._mounts)}): unset the proxy env")
            built._transport = httpx2.MockTransport(mock_handler(httpx2, bodies))
            transport += " (replaced by httpx2.MockTransport)"
        return client, transport
    if kind == "httpx":
        import httpx

        http = httpx.Client(transport=httpx.MockTransport(mock_handler(httpx, bodies))) if bodies is not None \
            else httpx.Client()
        transport = "httpx.Client with " + ("httpx.MockTransport" if bodies is not None else "httpx.HTTPTransport")
        return openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, http_client=http), transport
    raise ValueError(f"unknown client {kind!r} (one of {', '.join(CLIENTS)})")


def matches_payload(bodies: dict, prompt_ids: Any, response_ids: Any, logprobs: Any) -> bool:
    """Whether recorded ids and log-probs are exactly those of one of the answers sent."""
    import orjson

    for raw in bodies[(True, True)]:
        data = orjson.loads(raw)
        choice = data["choices"][0]
        if list(prompt_ids) == data["prompt_token_ids"] and list(response_ids) == choice["token_ids"]:
            expected = [x["logprob"] for x in choice["logprobs"]["content"]]
            return logprobs is not None and len(logprobs) == len(expected) and all(
                abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(logprobs, expected))
    return False


class Worker:
    """One contender's blocks. ``server_cpu_ns`` (AGL): a process whose CPU is added to each block's."""

    server_pid: int | None = None

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.prompt, self.response = (int(x) for x in args.shape.split("+"))
        self.calls = args.calls
        self.bodies = load_bodies(args.bodies)
        self.tmp = Path(args.tmp)
        self.captured_blocks = 0
        self.info: dict[str, Any] = {}

    def call(self, client: Any) -> Any:
        return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=self.response,
                                              temperature=1.0)

    def untraced(self) -> int:
        raise NotImplementedError

    def captured(self) -> int:
        raise NotImplementedError

    def warm_up(self) -> None:
        self.captured(), self.untraced()

    def check(self) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def run(self, serve: Callable[[], None]) -> None:
        serve()


class OtelWorker(Worker):
    def __init__(self, args: argparse.Namespace, content: bool) -> None:
        super().__init__(args)
        self.content = content
        if content:
            os.environ[CONTENT_ENV] = "SPAN_ONLY"
        else:
            os.environ.pop(CONTENT_ENV, None)
        from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

        class Keep(SpanExporter):
            """Receives every span (counted), keeps the last one for the check."""

            def __init__(self) -> None:
                self.count, self.last = 0, None

            def export(self, spans: Any) -> Any:
                self.count += len(spans)
                if spans:
                    self.last = spans[-1]
                return SpanExportResult.SUCCESS

            def shutdown(self) -> None:
                pass

        self.exporter = Keep()
        self.provider = TracerProvider()
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        OpenAIInstrumentor().instrument(tracer_provider=self.provider)
        self.client, self.info["transport"] = openai_client(args.client, self.bodies)
        create = self.client.chat.completions.create
        if not hasattr(create, "__wrapped__"):
            raise RuntimeError("chat.completions.create is not wrapped by the OpenTelemetry instrumentation")

    def untraced(self) -> int:
        for _ in range(self.calls):  # the client's own method, without the instrumentation's wrapper
            self.client.chat.completions.create.__wrapped__(model="tiny", messages=MESSAGES, max_tokens=self.response,
                                                             temperature=1.0)
        return self.calls

    def captured(self) -> int:
        for _ in range(self.calls):
            self.call(self.client)
        self.provider.force_flush()  # the batch processor's thread exports them, timed in this block
        self.captured_blocks += 1
        return self.calls

    def check(self) -> dict[str, Any]:
        self.provider.force_flush()
        expected = self.captured_blocks * self.calls
        span = self.exporter.last
        attrs = dict(span.attributes or {}) if span is not None else {}
        content_keys = sorted(k for k in attrs if k in ("gen_ai.input.messages", "gen_ai.output.messages"))
        out = {"spans_exported": self.exporter.count, "spans_expected": expected,
               "last_span": span.name if span is not None else None,
               "last_span_attributes": sorted(attrs), "content_attributes": content_keys}
        problems = []
        if self.exporter.count != expected:
            problems.append(f"{self.exporter.count} spans exported, {expected} expected (one per captured call)")
        if attrs.get("gen_ai.usage.output_tokens") != self.response:
            problems.append(f"gen_ai.usage.output_tokens is {attrs.get('gen_ai.usage.output_tokens')!r}")
        if self.content:
            out_messages = attrs.get("gen_ai.output.messages")
            if len(content_keys) != 2 or not out_messages or "x" * self.response not in str(out_messages):
                problems.append(f"message content missing with {CONTENT_ENV}=SPAN_ONLY (attributes {content_keys})")
        elif content_keys:
            problems.append(f"message content recorded without {CONTENT_ENV}: {content_keys}")
        out["ok"], out["problems"] = not problems, problems
        return out


class LightningWorker(Worker):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        import lightning_rl as lrl

        self.lrl = lrl
        self.store = lrl.configure(store=f"sqlite:///{self.tmp / f'lrl-{args.shape}-{args.client}.db'}")
        self.client, self.info["transport"] = openai_client(args.client, self.bodies)
        self.rollout_id: str | None = None

    def block(self) -> int:
        for _ in range(self.calls):
            self.call(self.client)
        return self.calls

    def untraced(self) -> int:
        return contextvars.Context().run(self.block)  # an empty context: no rollout, nothing recorded

    def captured(self) -> int:
        self.block()
        self.store.flush()  # the writer thread's work for these calls is done, and timed, in this block
        self.captured_blocks += 1
        return self.calls

    def run(self, serve: Callable[[], None]) -> None:
        lrl = self.lrl

        @lrl.trace
        def agent() -> None:
            self.rollout_id = lrl.current_rollout_id()
            serve()

        agent()

    def check(self) -> dict[str, Any]:
        lrl = self.lrl
        self.store.flush()
        calls = lrl.trajectory(self.store, self.rollout_id).llm_calls
        expected = self.captured_blocks * self.calls
        last = calls[-1] if calls else None
        out: dict[str, Any] = {"llm_calls_stored": len(calls), "llm_calls_expected": expected}
        problems = []
        if len(calls) != expected:
            problems.append(f"{len(calls)} LLM calls stored, {expected} expected")
        if last is None or not matches_payload(self.bodies, last.prompt_token_ids or [], last.response_token_ids or [],
                                                last.response_logprobs):
            problems.append("the last stored call's token ids / log-probs are not those of an answer sent")
        else:
            out["last_call"] = {"prompt_token_ids": len(last.prompt_token_ids),
                                "response_token_ids": len(last.response_token_ids),
                                "response_logprobs": len(last.response_logprobs)}
        out["answer_read_from_bytes"] = self.read_path()
        out["ok"], out["problems"] = not problems, problems
        return out

    def read_path(self) -> bool | None:
        """Whether a captured call on this client reads the answer from the engine's bytes (``read_answer_bytes``,
        before the client parses it) rather than from the client's objects: one more call, after the rounds."""
        from lightning_rl.capture import CapturedCall

        seen: list[bool] = []
        original = CapturedCall.record_response

        def spy(call: Any, resp: Any) -> None:
            seen.append(call.read_as_bytes)
            original(call, resp)

        CapturedCall.record_response = spy
        try:
            self.lrl.trace(lambda: self.call(self.client))()
        finally:
            CapturedCall.record_response = original
        return seen[-1] if seen else None


def proc_cpu_ns(pid: int) -> int:
    """CPU time of process ``pid`` and its descendants, all threads, in ns (schedstat: not the 10 ms ticks)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                total += sum(proc_cpu_ns(int(c)) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def proc_ticks_ns(pid: int) -> int:
    """utime + stime of ``pid`` (dead threads included), in ns, at the clock tick's resolution."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AglWorker(Worker):
    """Agent Lightning 1.0.2's server (its LLM proxy and in-memory store) in a process of its own, as shipped; the
    upstream a local server in another; the client here."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        import agentlightning

        self.info["agentlightning"] = agentlightning.__version__
        self.children: list[subprocess.Popen] = []
        try:
            self._start(args)
        except BaseException:
            self.close()  # the servers started so far
            raise

    def _start(self, args: argparse.Namespace) -> None:
        import httpx

        fake = subprocess.Popen([sys.executable, __file__, "--serve-fake-vllm", args.bodies], stdout=subprocess.PIPE,
                                stderr=open(self.tmp / f"fake-vllm-{os.getpid()}.log", "wb"), text=True)
        self.children.append(fake)
        line = fake.stdout.readline().split()
        if len(line) != 2 or line[0] != "PORT":
            raise RuntimeError(f"the fake vLLM server did not start (see {self.tmp}/fake-vllm-*.log)")
        upstream = f"http://127.0.0.1:{line[1]}/v1"
        port = free_port()
        self.server_log = self.tmp / f"agl-server-{os.getpid()}.log"
        server = subprocess.Popen(
            [sys.executable, "-m", "agentlightning.server", "host=127.0.0.1", f"port={port}",
             "default_proxy.model_name=tiny", f"hydra.run.dir={self.tmp / f'agl-hydra-{os.getpid()}'}",
             "hydra.output_subdir=null"],
            cwd=self.tmp, stdout=open(self.server_log, "wb"), stderr=subprocess.STDOUT)
        self.children.append(server)
        self.server_pid = server.pid
        self.api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the Agent Lightning server exited ({server.returncode}): "
                                   f"{self.server_log.read_text()[-2000:]}")
            try:
                if self.api.get("/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the Agent Lightning server did not answer /healthz within 120 s")
            time.sleep(0.2)
        self.api.post("/api/models", json=[{"model": "tiny", "endpoint": upstream}]).raise_for_status()
        self.rollout_id, self.attempt_id = f"bench-{os.getpid()}", "0"  # "0": the attempt its queries read
        self.api.post("/api/rollouts", json=[{"rollout_id": self.rollout_id, "input": {}}]).raise_for_status()
        proxy = (f"http://127.0.0.1:{port}/proxy/rollout/{self.rollout_id}/attempt/{self.attempt_id}"
                 "/mode/train/openai/v1")
        self.info["proxy_route"] = proxy
        self.direct, transport = openai_client(args.client, None, upstream)
        self.proxied, _ = openai_client(args.client, None, proxy)
        self.info["transport"] = transport + " (real sockets: a server proxies)"
        self.server_ns: list[int] = []  # per block, in the order the blocks ran
        self.ticks0 = proc_ticks_ns(server.pid)
        self.sched0 = proc_cpu_ns(server.pid)

    def _block(self, client: Any) -> int:
        t0 = proc_cpu_ns(self.server_pid)
        for _ in range(self.calls):
            self.call(client)
        self.server_ns.append(proc_cpu_ns(self.server_pid) - t0)
        return self.calls

    def untraced(self) -> int:
        return self._block(self.direct)

    def captured(self) -> int:
        self._block(self.proxied)  # the proxy records the event before it answers: nothing left to flush
        self.captured_blocks += 1
        return self.calls

    def check(self) -> dict[str, Any]:
        expected = self.captured_blocks * self.calls
        events = self.api.get(f"/api/rollouts/{self.rollout_id}/events", params={"event_type": "model_request"})
        events.raise_for_status()
        count = len(events.json())
        triplets = self.api.get(f"/api/rollouts/{self.rollout_id}/events", params={"format": "triplet"}).json()
        last = triplets[-1]["data"] if triplets else {}
        out: dict[str, Any] = {"model_request_events": count, "events_expected": expected,
                               "server_cpu_schedstat_s": (proc_cpu_ns(self.server_pid) - self.sched0) / 1e9,
                               "server_cpu_ticks_s": (proc_ticks_ns(self.server_pid) - self.ticks0) / 1e9}
        problems = []
        if count != expected:
            problems.append(f"{count} model_request events stored, {expected} expected")
        if not matches_payload(self.bodies, last.get("prompt_token_ids") or [], last.get("response_token_ids") or [],
                               last.get("response_log_probs")):
            problems.append("the last event's token ids / log-probs (triplet query) are not those of an answer sent")
        else:
            out["last_event"] = {"prompt_token_ids": len(last["prompt_token_ids"]),
                                 "response_token_ids": len(last["response_token_ids"]),
                                 "response_log_probs": len(last["response_log_probs"])}
        out["ok"], out["problems"] = not problems, problems
        return out

    def close(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()


class FloorWorker(Worker):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        import sqlite3

        import orjson
        from lightning_rl.records import PackedTokens

        self.loads, self.pack = orjson.loads, PackedTokens.of
        self.path = self.tmp / f"floor-{args.shape}.db"
        self.conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = NORMAL")
        self.conn.execute("CREATE TABLE calls (rollout_id TEXT, seq INTEGER, prompt_token_ids BLOB, "
                          "response_token_ids BLOB, response_logprobs BLOB)")
        self.plain, self.full = self.bodies[(False, False)], self.bodies[(True, True)]
        self.seq = 0
        self.info["transport"] = "none (answer bytes in memory)"

    def untraced(self) -> int:
        loads, plain, n = self.loads, self.plain, len(self.plain)
        for i in range(self.calls):
            loads(plain[i % n])
        return self.calls

    def captured(self) -> int:
        from lightning_rl.capture import gc_paused

        loads, pack, full, n = self.loads, self.pack, self.full, len(self.full)
        rows = []
        for i in range(self.calls):
            with gc_paused():  # as the capture parses an answer (issue 57): its dicts set off no collection
                data = loads(full[i % n])
                choice = data["choices"][0]
                tokens = pack(data["prompt_token_ids"], choice["token_ids"],
                              [x["logprob"] for x in choice["logprobs"]["content"]])
                del data, choice
            self.seq += 1
            rows.append(("bench", self.seq, tokens.prompt, tokens.response, tokens.logprobs))
        self.conn.execute("BEGIN")
        self.conn.executemany("INSERT INTO calls VALUES (?, ?, ?, ?, ?)", rows)
        self.conn.execute("COMMIT")
        self.captured_blocks += 1
        return self.calls

    def check(self) -> dict[str, Any]:
        from lightning_rl.records.spans import unpack_ids, unpack_logprobs

        expected = self.captured_blocks * self.calls
        count = self.conn.execute("SELECT count(*) FROM calls").fetchone()[0]
        prompt, response, logprobs = self.conn.execute(
            "SELECT prompt_token_ids, response_token_ids, response_logprobs FROM calls ORDER BY seq DESC LIMIT 1"
        ).fetchone()
        problems = []
        if count != expected:
            problems.append(f"{count} rows, {expected} expected")
        if not matches_payload(self.bodies, unpack_ids(prompt), unpack_ids(response), unpack_logprobs(logprobs)):
            problems.append("the last row's ids / log-probs are not those of an answer")
        return {"rows": count, "rows_expected": expected, "ok": not problems, "problems": problems}


def worker_main(args: argparse.Namespace) -> None:
    # the protocol goes to the original stdout; anything a library prints goes to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**message: Any) -> None:
        proto.write(json.dumps(message) + "\n")
        proto.flush()

    worker: Worker | None = None
    try:
        name = args.worker
        if name in ("otel-openai-v2", "otel-openai-v2-content"):
            worker = OtelWorker(args, content=name.endswith("content"))
        elif name in ("lightning-rl", "lightning-rl-py312"):
            worker = LightningWorker(args)
        elif name == "agent-lightning":
            worker = AglWorker(args)
        elif name == "floor":
            worker = FloorWorker(args)
        else:
            raise ValueError(f"unknown contender {name!r}")
    except BaseException as exc:
        reply(ready=False, reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        if worker is not None:
            worker.close()
        return
    w = worker

    def serve() -> None:
        w.warm_up()  # the schema, the writer thread, connections, the first calls' caches
        if isinstance(w, AglWorker):
            w.server_ns.clear()
        reply(ready=True, python=platform.python_version(), executable=sys.executable, versions=versions(*PACKAGES),
              info=w.info)
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] != "round":
                break
            blocks = {"untraced": w.untraced, "captured": w.captured}
            order = command["order"]
            ns_before = len(getattr(w, "server_ns", ()))
            result = cpu_rounds({k: blocks[k] for k in order}, 1, collect=True)
            us = {k: v[0] for k, v in result.items()}
            if w.server_pid is not None:  # the server's CPU of each block, per call, added to the client's
                for k, ns in zip(order, w.server_ns[ns_before:]):
                    us[f"server_{k}"] = ns / 1000 / w.calls
                    us[k] += ns / 1000 / w.calls
            reply(**us)

    try:
        w.run(serve)
        reply(check=w.check())
    except BaseException as exc:
        reply(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
    finally:
        w.close()


# ---------------------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------------------

class Contender:
    """A running worker, as the driver sees it."""

    def __init__(self, name: str, python: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.python, self.log = name, python, log
        self.rounds: dict[str, list[float]] = {"untraced": [], "captured": [], "server_untraced": [],
                                               "server_captured": []}
        self.failed: str | None = None
        self.ready: dict[str, Any] = {}
        self.check: dict[str, Any] | None = None
        # a session of its own: a worker that fails is killed with what it started (Agent Lightning's server)
        self.proc = subprocess.Popen([python, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(log, "wb"), env=env, text=True, bufsize=1, start_new_session=True)

    def ask(self, command: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.failed:
            return None
        try:
            if command is not None:
                self.proc.stdin.write(json.dumps(command) + "\n")
                self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT)
            line = self.proc.stdout.readline() if ready else ""
        except (BrokenPipeError, OSError) as exc:
            line = ""
            self.fail(f"worker pipe: {exc}")
        if not line:
            self.fail(f"worker exited or stalled (rc {self.proc.poll()}): {self.log_tail()}")
            return None
        message = json.loads(line)
        if message.get("error"):
            self.fail(f"{message['error']} | {message.get('traceback', '')[-600:]}")
            return None
        return message

    def fail(self, reason: str) -> None:
        self.failed = self.failed or reason
        self.kill()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own process group (start_new_session)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-800:]
        except OSError:
            return ""

    def finish(self) -> None:
        if not self.failed:
            message = self.ask({"cmd": "done"})
            if message is not None:
                self.check = message.get("check")
                if not self.check or not self.check.get("ok"):
                    self.fail(f"check failed: {'; '.join((self.check or {}).get('problems', ['no check']))}")
        try:
            self.proc.stdin.close()
            self.proc.wait(60)
        except (subprocess.TimeoutExpired, OSError):
            self.kill()


def usable_python(path: str, module: str) -> str | None:
    """None if ``path`` runs and imports ``module``, else why not."""
    if not (Path(path).exists() or "/" not in path):
        return f"{path} not found (make venv-agl builds .venv-agl)"
    try:
        done = subprocess.run([path, "-c", f"import {module}"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{path}: {exc}"
    if done.returncode != 0:
        return f"{path} cannot import {module}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ''}"
    return None


def write_bodies(prompt: int, response: int, path: Path) -> None:
    from bench_capture_cost import PAYLOADS, vllm_body

    bodies = {(ids, lps): [vllm_body(prompt, response, seed, ids=ids, logprobs=lps) for seed in range(PAYLOADS)]
              for ids in (False, True) for lps in (False, True)}
    with open(path, "wb") as f:
        pickle.dump(bodies, f)


def run_group(shape: str, client: str, names: list[str], args: argparse.Namespace, tmp: Path, bodies: Path,
              skipped: dict[str, str], workers_env: dict[str, Any]) -> list[dict[str, Any]]:
    prompt, response = (int(x) for x in shape.split("+"))
    calls = args.calls or calls_for(prompt, response)
    running: list[Contender] = []
    results: list[dict[str, Any]] = []
    for name in names:
        if name in skipped:
            results.append({"shape": shape, "client": client, "contender": name, "status": "skipped",
                            "reason": skipped[name]})
            continue
        python = args.agl_python if name in AGL_CONTENDERS else sys.executable
        env = {k: v for k, v in os.environ.items() if k != CONTENT_ENV}
        argv = ["--worker", name, "--shape", shape, "--client", client, "--calls", str(calls), "--bodies", str(bodies),
                "--tmp", str(tmp)]
        running.append(Contender(name, python, argv, env, tmp / f"worker-{name}-{shape}-{client}.log"))
    for c in running:  # set-up and warm-up, all at once
        message = c.ask(None)
        if message is not None and not message.get("ready"):
            c.fail(f"could not start: {message.get('reason')}")
            c.ready = message
        elif message is not None:
            c.ready = message
            where = workers_env.setdefault(message.get("executable"), {"python": message.get("python"),
                                                                       "versions": message.get("versions"),
                                                                       "contenders": []})
            if c.name not in where["contenders"]:
                where["contenders"].append(c.name)
    for r in range(args.rounds):
        order = ["untraced", "captured"] if r % 2 == 0 else ["captured", "untraced"]
        turn = running[r % len(running):] + running[:r % len(running)] if running else []
        for c in turn:
            reply = c.ask({"cmd": "round", "order": order})
            if reply is not None:
                for k, v in reply.items():
                    c.rounds.setdefault(k, []).append(v)
        alive = [c.name for c in running if not c.failed]
        print(f"  {shape} {client} round {r + 1}/{args.rounds} ({len(alive)} of {len(running)} contenders running)",
              file=sys.stderr, flush=True)
    for c in running:
        c.finish()
    for c in running:
        row: dict[str, Any] = {"shape": shape, "client": client, "contender": c.name, "calls_per_block": calls,
                               "rounds": len(c.rounds["captured"]), "python": c.ready.get("python"),
                               "info": c.ready.get("info"), "check": c.check}
        if c.failed:
            row.update(status="failed", reason=c.failed)
        else:
            adds = [a - b for a, b in zip(c.rounds["captured"], c.rounds["untraced"])]
            row.update(status="ok", untraced_call_us=summary(c.rounds["untraced"]),
                       captured_call_us=summary(c.rounds["captured"]), adds_us=summary(adds),
                       ns_per_token=round(summary(adds)["median"] * 1000 / (prompt + response), 1))
            if c.rounds.get("server_captured"):
                server = [a - b for a, b in zip(c.rounds["server_captured"], c.rounds["server_untraced"])]
                row["server_adds_us"] = summary(server)
        results.append(row)
    return results


def add_ratios(results: list[dict[str, Any]]) -> None:
    """lightning-rl's median over each other contender's, same shape and client; under the contender's own Python
    (lightning-rl-py312 for agent-lightning) where both were measured, else lightning-rl's."""
    figures = {(r["shape"], r["client"], r["contender"]): r for r in results if r.get("status") == "ok"}
    for r in results:
        if r.get("status") != "ok" or r["contender"].startswith("lightning-rl"):
            continue
        ours = None
        if r["contender"] == "agent-lightning":
            ours = figures.get((r["shape"], r["client"], "lightning-rl-py312"))
        if ours is None:
            ours = figures.get((r["shape"], r["client"], "lightning-rl"))
        if r["contender"] == "floor" and ours is None:
            continue
        if ours is not None and r["adds_us"]["median"]:
            r["ratio_lightning_rl"] = {"lightning_rl": ours["contender"],
                                       "value": round(ours["adds_us"]["median"] / r["adds_us"]["median"], 3)}


def print_table(results: list[dict[str, Any]]) -> None:
    print("\nCPU that capturing one LLM call adds (us per call, median over rounds; untraced/captured: the whole "
          "call's CPU)")
    print(f"{'shape':>10} {'client':8} {'contender':24} {'py':>5} {'N':>4} {'untraced':>9} {'captured':>9} "
          f"{'adds':>9} {'min..max':>17} {'ns/tok':>7} {'ours/it':>8}  check")
    for r in results:
        head = f"{r['shape']:>10} {r['client']:8} {r['contender']:24} {(r.get('python') or '')[:4]:>5} " \
               f"{r.get('calls_per_block', ''):>4}"
        if r.get("status") != "ok":
            print(f"{head} {r['status'].upper()}: {r.get('reason', '')[:300]}")
            continue
        ratio = r.get("ratio_lightning_rl")
        extra = f" (server +{r['server_adds_us']['median']:.0f})" if "server_adds_us" in r else ""
        print(f"{head} {r['untraced_call_us']['median']:9.1f} {r['captured_call_us']['median']:9.1f} "
              f"{r['adds_us']['median']:9.1f} {r['adds_us']['min']:8.1f}..{r['adds_us']['max']:<8.1f} "
              f"{r['ns_per_token']:7.1f} {ratio['value'] if ratio else '':>8}  ok{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="40+4,512+128,4000+1000", help="prompt+response tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=0,
                        help="calls per block (default: about 10,000 tokens' worth per block, 5 to 200)")
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--agl-python", default=str(ROOT / ".venv-agl" / "bin" / "python"),
                        help="the Python 3.12 with agentlightning 1.0.2 and lightning-rl (make venv-agl)")
    parser.add_argument("--json-out", help="also write the JSON line to this file")
    # worker modes (internal)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--serve-fake-vllm", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--client", help=argparse.SUPPRESS)
    parser.add_argument("--bodies", help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake_vllm:
        return serve_fake_vllm(args.serve_fake_vllm)
    if args.worker:
        return worker_main(args)

    names = [n for n in args.contenders.split(",") if n]
    clients = [c for c in args.clients.split(",") if c]
    unknown = [n for n in names if n not in CONTENDERS] + [c for c in clients if c not in CLIENTS]
    if unknown:
        parser.error(f"unknown contender or client: {', '.join(unknown)} (contenders: {', '.join(CONTENDERS)}; "
                     f"clients: {', '.join(CLIENTS)})")
    skipped: dict[str, str] = {}
    for name in names:
        if name in AGL_CONTENDERS:
            why = usable_python(args.agl_python, "agentlightning" if name == "agent-lightning" else "lightning_rl")
            if why:
                skipped[name] = why
        elif name.startswith("otel"):
            why = usable_python(sys.executable, "opentelemetry.instrumentation.openai_v2")
            if why:
                skipped[name] = (f"{why} (pip install opentelemetry-instrumentation-openai-v2==2.4b0 "
                                 "opentelemetry-util-genai==1.1b0)")
    for name, why in skipped.items():
        print(f"{name}: {why}", file=sys.stderr)

    env: dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable,
                           "platform": platform.platform(), "cpus": os.cpu_count(),
                           "loadavg_start": os.getloadavg(), "versions": versions(*PACKAGES)}
    tmp = Path(tempfile.mkdtemp(prefix="lrl-bench-peers-"))
    print(f"workers' logs and stores: {tmp} (removed at the end unless a contender failed)", file=sys.stderr)
    results: list[dict[str, Any]] = []
    env["workers"] = {}
    started = time.monotonic()
    for shape in args.shapes.split(","):
        prompt, response = (int(x) for x in shape.split("+"))
        bodies = tmp / f"bodies-{shape}.pickle"
        write_bodies(prompt, response, bodies)
        for i, client in enumerate(clients):
            group = [n for n in names if n != "floor" or i == 0]
            results.extend(run_group(shape, client, group, args, tmp, bodies, skipped, env["workers"]))
    add_ratios(results)
    env["loadavg_end"] = os.getloadavg()
    env["wall_s"] = round(time.monotonic() - started, 1)
    print_table(results)
    out = {"bench": "capture_peers", "rounds": args.rounds, "shapes": args.shapes.split(","), "clients": clients,
           "contenders": names, "env": env, "results": results}
    line = json.dumps(out)
    print(line)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(line + "\n")
    if any(r.get("status") == "failed" for r in results):  # what a failed worker left is what says why
        print(f"kept for the failed contenders: {tmp}", file=sys.stderr)
    else:  # the stores alone are tens of MB a run
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
