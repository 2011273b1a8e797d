"""The FastAPI app: /v1/completions, /v1/chat/completions (SSE when asked), /v1/models, /health, /metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from memfit.server import protocol as p
from memfit.server.backends import Sampling
from memfit.server.engine import Engine, Job
from memfit.server.follower import Holder
from memfit.server.logprobs import CompletionChunks, chat_logprobs, completion_logprobs
from memfit.server.metrics import CONTENT_TYPE, Metrics


@dataclass
class ServerState:
    holder: Holder
    engine: Engine
    metrics: Metrics
    aliases: set[str] = field(default_factory=set)  # MODEL as given (models:/NAME@ALIAS), NAME@ALIAS
    follower: Any = None
    started: float = field(default_factory=time.time)


class _MetricsMiddleware:
    """Counts every answer by endpoint and status and times it to its last byte (streams included)."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]

        async def wrapped(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self.metrics.answered(scope["path"], status[0], time.perf_counter() - start)
            await send(message)

        await self.app(scope, receive, wrapped)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="memfit serve-model", description="OpenAI-compatible completions from a memfit export.")
    app.state.memfit = state
    app.add_middleware(_MetricsMiddleware, metrics=state.metrics)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = p.validation_message(list(exc.errors()))
        return JSONResponse(p.error_body(message, param=param), status_code=400)

    @app.exception_handler(p.RequestError)
    async def _refused(request: Request, exc: p.RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        served = state.holder.current
        return {"status": "ok", "model": served.model_id, "version": served.files.version,
                "backend": served.backend.name, "queue": state.engine.depth(), "last_error": state.holder.last_error,
                "swaps": state.holder.swaps, "uptime_s": round(time.time() - state.started, 1)}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.queue_depth.set(state.engine.depth())
        return Response(state.metrics.text(), media_type=CONTENT_TYPE)

    @app.post("/admin/refresh")
    async def refresh() -> dict[str, Any]:
        """Poll the registry now (a retrain flow calls this after moving the alias) instead of at the next poll."""
        if state.follower is None:
            raise p.RequestError(400, "this server was started on a fixed model, not models:/NAME@ALIAS: there is "
                                      "no alias to follow", code="not_following")
        await asyncio.to_thread(state.follower.poll_once)
        return await health()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        served = state.holder.current
        ids = [served.model_id] + sorted(served.names - {served.model_id})
        return {"object": "list", "data": [{"id": i, "object": "model", "created": int(state.started),
                                            "owned_by": "memfit", "root": served.model_id} for i in ids]}

    @app.post("/v1/completions")
    async def completions(req: p.CompletionRequest) -> Any:
        served = _served(state, req.model)
        prompt = p.single_prompt(req)
        ids = p.checked_ids(prompt, len(served.tokenizer)) if isinstance(prompt, list) else served.encode(prompt)
        top = p.scoring(req)
        job = _submit(state, served, req, ids, top=top, score_from=0 if req.echo else len(ids))
        rid = p.new_id("cmpl")
        echoed = (served.tokenizer.decode(ids) if isinstance(prompt, list) else prompt) if req.echo else ""
        if req.stream:
            shape = None if top is None else CompletionChunks(served.piece)
            return _sse(_completion_chunks(job, rid, len(ids), echoed, shape), job, state, ids)
        await _wait(job)
        _count(state, ids, job)
        # Offsets index the returned text: with echo it starts with the prompt.
        logprobs = None if top is None else completion_logprobs(job.scored, served.piece)
        return p.completion_body(rid, job.model_id, echoed + job.text, job.finish, len(ids), len(job.tokens),
                                 logprobs)

    @app.post("/v1/chat/completions")
    async def chat(req: p.ChatRequest) -> Any:
        served = _served(state, req.model)
        if not served.has_chat_template:
            raise p.RequestError(400, f"{served.model_id} has no chat template (its tokenizer_config.json sets no "
                                      "chat_template): use /v1/completions, or export a tokenizer that has one",
                                 "messages", code="no_chat_template")
        prompt = served.chat_prompt([m.model_dump() for m in req.messages])
        ids = served.encode(prompt)
        top = p.scoring(req)
        job = _submit(state, served, req, ids, req.max_completion_tokens or req.max_tokens, top, len(ids))
        rid = p.new_id("chatcmpl")
        if req.stream:
            shape = None if top is None else lambda scored: chat_logprobs(scored, served.piece)
            return _sse(_chat_chunks(job, rid, shape), job, state, ids)
        await _wait(job)
        _count(state, ids, job)
        logprobs = None if top is None else chat_logprobs(job.scored, served.piece)
        return p.chat_body(rid, job.model_id, job.text, job.finish, len(ids), len(job.tokens), logprobs)

    return app


def _served(state: ServerState, name: str) -> Any:
    served = state.holder.current
    if name not in served.names | state.aliases:
        known = ", ".join(sorted(served.names | state.aliases))
        raise p.RequestError(404, f"model {name!r} is not served here; this server serves {known}", "model",
                             code="model_not_found")
    return served


def _submit(state: ServerState, served: Any, req: Any, ids: list[int], requested: int | None = None,
            top: int | None = None, score_from: int = 0) -> Job:
    max_new = p.max_new_tokens(requested if requested is not None else req.max_tokens, len(ids), served.limits)
    sampling = Sampling(temperature=req.temperature, top_p=req.top_p if req.temperature else 1.0,
                        seed=req.seed if req.temperature else None)
    job = Job(prompt_ids=ids, max_new=max_new, sampling=sampling, stops=p.stops(req), loop=asyncio.get_running_loop(),
              top=top, score_from=score_from, stream=req.stream)
    state.engine.submit(job)
    return job


def _count(state: ServerState, ids: list[int], job: Job) -> None:
    state.metrics.counted(len(ids), len(job.tokens))


async def _wait(job: Job) -> None:
    """Until the job ends; a failed generation becomes a 500 with the reason (the server keeps serving)."""
    while True:
        kind, *rest = await job.events.get()
        if kind == "end":
            return
        if kind == "error":
            raise p.RequestError(500, rest[0], code="generation_failed")


async def _events(job: Job) -> AsyncIterator[tuple]:
    while True:
        event = await job.events.get()
        yield event
        if event[0] in ("end", "error"):
            return


def _sse(chunks: AsyncIterator[dict], job: Job, state: ServerState, ids: list[int]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not job.done:  # the client went away: the generation thread drops the sequence
                job.cancelled = True
            _count(state, ids, job)

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


Shape = Callable[[list], dict[str, Any]] | None  # a chunk's Scored → its logprobs object; None: not asked for


async def _completion_chunks(job: Job, rid: str, prompt_tokens: int, echoed: str, shape: Shape) -> AsyncIterator[dict]:
    def body(text: str, scored: list, finish: str | None = None, completion: int | None = None) -> dict:
        return p.completion_body(rid, job.model_id, text, finish, prompt_tokens, completion,
                                 None if shape is None else shape(scored))

    async for kind, *rest in _events(job):
        if kind == "start" and echoed:
            yield body(echoed, rest[1])
        elif kind == "delta":
            yield body(rest[0], rest[1])
        elif kind == "end":
            yield body("", rest[1], job.finish, len(job.tokens))
        elif kind == "error":
            yield p.error_body(rest[0], "generation_failed")


async def _chat_chunks(job: Job, rid: str, shape: Shape) -> AsyncIterator[dict]:
    def chunk(delta: dict[str, str], scored: list, finish: str | None = None) -> dict:
        return p.chat_chunk(rid, job.model_id, delta, finish, None if shape is None else shape(scored))

    async for kind, *rest in _events(job):
        if kind == "start":
            yield chunk({"role": "assistant", "content": ""}, rest[1])
        elif kind == "delta":
            yield chunk({"content": rest[0]}, rest[1])
        elif kind == "end":
            yield chunk({}, rest[1], job.finish)
        elif kind == "error":
            yield p.error_body(rest[0], "generation_failed")
