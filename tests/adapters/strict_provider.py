"""A hosted-provider stand-in on 127.0.0.1: an OpenAI-compatible server that, like OpenAI itself,
refuses request fields it does not know (HTTP 400), and answers /responses. Real HTTP, real client."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

KNOWN = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
         "stop", "seed", "tools", "tool_choice", "user"}


def make_app() -> FastAPI:
    app = FastAPI()
    app.state.requests = []
    app.state.paths = []

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        app.state.paths.append(request.url.path)
        unknown = sorted(set(body) - KNOWN)
        if unknown:
            return JSONResponse(status_code=400, content={"error": {
                "message": f"Unrecognized request argument supplied: {', '.join(unknown)}",
                "type": "invalid_request_error", "param": unknown[0], "code": None}})
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "42"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        app.state.paths.append(request.url.path)
        return {"id": "resp-1", "object": "response", "created_at": int(time.time()), "model": body["model"],
                "status": "completed", "parallel_tool_calls": False, "tool_choice": "auto", "tools": [],
                "output": [{"type": "message", "id": "msg-1", "role": "assistant", "status": "completed",
                            "content": [{"type": "output_text", "text": "42", "annotations": []}]}]}

    return app


class StrictProvider:
    """``with StrictProvider() as p: openai.OpenAI(base_url=p.base_url)``; ``p.requests`` are the bodies seen."""

    def __init__(self) -> None:
        self.app = make_app()
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def requests(self) -> list[dict]:
        return self.app.state.requests

    @property
    def paths(self) -> list[str]:
        return self.app.state.paths

    def __enter__(self) -> "StrictProvider":
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()
