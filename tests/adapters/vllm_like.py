"""An OpenAI-compatible engine on 127.0.0.1 that answers as vLLM does (``prompt_token_ids`` and each
choice's ``token_ids`` when the request asks for ``return_token_ids``, log-probs when it asks for them),
counts what it is sent, and can be told to refuse every request with a 400 that has nothing to do with
the token fields (a context-length error). Real HTTP, for the clients that are not openai's."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from lightning_rl.serving import ServerThread

CONTEXT_ERROR = ("This model's maximum context length is 2048 tokens. However, you requested 4096 tokens "
                 "(4000 in the messages, 96 in the completion). Please reduce the length of the messages.")


def make_app() -> FastAPI:
    app = FastAPI()
    app.state.requests = []
    app.state.headers = []
    app.state.refuse = False

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        app.state.headers.append(dict(request.headers))
        if app.state.refuse:
            return JSONResponse(status_code=400, content={"object": "error", "message": CONTEXT_ERROR,
                                                          "type": "BadRequestError", "code": 400})
        ids = bool(body.get("return_token_ids"))
        logprobs = {"content": [{"token": "4", "logprob": -0.25, "bytes": None, "top_logprobs": []},
                                {"token": "2", "logprob": -0.5, "bytes": None, "top_logprobs": []}]} \
            if body.get("logprobs") else None
        if body.get("stream"):  # as vLLM streams: the prompt's ids in the first chunk, each token's with it
            first = {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": body.get("model"),
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            chunks = [{"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": body.get("model"),
                       "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": reason,
                                    "logprobs": {"content": [logprobs["content"][i]]} if logprobs else None,
                                    **({"token_ids": [tid]} if ids else {})}]}
                      for i, (text, tid, reason) in enumerate((("4", 19, None), ("2", 20, "stop")))]
            if ids:
                first["prompt_token_ids"] = [11, 12, 13]

            def events():
                for chunk in (first, *chunks):
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        answer: dict[str, Any] = {
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body.get("model"),
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": logprobs,
                         "message": {"role": "assistant", "content": "42"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
        if ids:
            answer["prompt_token_ids"] = [11, 12, 13]
            answer["choices"][0]["token_ids"] = [19, 20]
        return answer

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await request.json()
        app.state.requests.append(body)
        return {"id": "msg_1", "type": "message", "role": "assistant", "model": body.get("model"),
                "content": [{"type": "text", "text": "42"}], "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 3, "output_tokens": 1}}

    return app


class VLLMLike:
    """``with VLLMLike() as engine: openai.OpenAI(base_url=engine.base_url)``."""

    def __init__(self) -> None:
        self.app = make_app()
        self._thread = ServerThread(self.app, name="vllm-like")
        self.url = self._thread.url
        self.base_url = self.url + "/v1"

    @property
    def requests(self) -> list[dict]:
        return self.app.state.requests

    def refuse_everything(self, refuse: bool = True) -> None:
        self.app.state.refuse = refuse

    def __enter__(self) -> "VLLMLike":
        self._thread.start("a vLLM-like engine")
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.stop()
