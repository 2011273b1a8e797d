"""The OpenAI wire format: request bodies checked against the served model's limits, response bodies built."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from memfit.server.logprobs import MAX_TOP


class RequestError(Exception):
    """A request the server will not run: answered with `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.code, self.param)


def error_body(message: str, code: str = "invalid_request_error", param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": code, "param": param, "code": code}}


class _Body(BaseModel):
    # Clients send fields this server does not use (user, logit_bias, ...): ignored, as OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., min_length=1, description="The served model's name, NAME@ALIAS or the current id.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0: greedy; above 0: sampling.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    n: int = Field(1, ge=1, le=1, description="Completions per prompt (only 1).")
    stream: bool = Field(False, description="Server-sent events, one chunk per token.")
    stop: str | list[str] | None = Field(None, description="Text that ends the completion (not included).")
    seed: int | None = Field(None, description="Sampling seed.")


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="The text to continue, or its token ids (a list of one prompt is accepted).")
    max_tokens: int | None = Field(None, ge=0, description="Most tokens to generate (0 only with echo: score the "
                                                           "prompt).")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP, description="Return each token's log-probability and the "
                                                                      "top-N alternatives at each position.")
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs when asked).")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Body):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name of max_tokens.")
    logprobs: bool = Field(False, description="Return each generated token's log-probability.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP, description="With logprobs: the top-N alternatives at "
                                                                          "each position.")


@dataclass(frozen=True)
class Limits:
    """What a request may ask of the served model."""

    context: int | None  # prompt + completion tokens the model's positions allow (None: no limit)
    max_tokens: int  # serve.max_tokens
    default_max_tokens: int


def single_prompt(req: CompletionRequest) -> str | list[int]:
    """The request's one prompt: text, or token ids (as lm-evaluation-harness sends them)."""
    if isinstance(req.prompt, str):
        return req.prompt
    if req.prompt and all(isinstance(t, int) for t in req.prompt):
        return list(req.prompt)  # type: ignore[arg-type]
    if len(req.prompt) != 1:
        raise RequestError(400, f"prompt: a list of {len(req.prompt)} prompts was sent; this server takes one "
                                "prompt per request (send several requests: they are batched)", "prompt")
    return req.prompt[0]  # type: ignore[return-value]


def checked_ids(ids: list[int], vocab: int) -> list[int]:
    """Token-id prompts must be ids of the served model's vocabulary."""
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(400, f"prompt: token id {bad} is outside the model's vocabulary of {vocab}; send ids the "
                                "served tokenizer produced", "prompt")
    return ids


def scoring(req: CompletionRequest | ChatRequest) -> int | None:
    """How many alternatives per position the request wants with its logprobs, or None (no logprobs)."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError(400, "top_logprobs: set logprobs to true as well", "top_logprobs")
        top = (req.top_logprobs or 0) if req.logprobs else None
    else:
        if req.max_tokens == 0 and not req.echo:
            raise RequestError(400, "max_tokens: 0 generates nothing; set echo to true to score the prompt, or ask "
                                    "for at least 1 token", "max_tokens")
        top = req.logprobs
    return top  # with stream too: each chunk carries its tokens' logprobs (engine.py)


def stops(req: _Body) -> list[str]:
    found = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(found) > 4 or any(not s for s in found):
        raise RequestError(400, "stop: up to 4 non-empty strings", "stop")
    return found


def max_new_tokens(requested: int | None, prompt_tokens: int, limits: Limits) -> int:
    """The completion budget of one request, or RequestError (400) naming the limit it exceeds."""
    if prompt_tokens == 0:
        raise RequestError(400, "the prompt is empty after tokenization; send some text", "prompt")
    want = requested if requested is not None else limits.default_max_tokens
    if want > limits.max_tokens:
        raise RequestError(400, f"max_tokens {want} is above this server's limit {limits.max_tokens} "
                                "(serve.max_tokens)", "max_tokens")
    if limits.context is not None:
        if prompt_tokens >= limits.context:
            raise RequestError(400, f"the prompt is {prompt_tokens} tokens; the model's context is {limits.context} "
                                    "tokens: shorten it", "prompt")
        if prompt_tokens + want > limits.context:
            if requested is None:  # the default alone must not turn a valid prompt into an error
                return limits.context - prompt_tokens
            raise RequestError(400, f"max_tokens {want} + prompt {prompt_tokens} tokens = {prompt_tokens + want} is "
                                    f"beyond the model's context of {limits.context} tokens: ask for at most "
                                    f"{limits.context - prompt_tokens}", "max_tokens")
    return want


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, text: str, finish: str | None, prompt_tokens: int,
                    completion_tokens: int | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if completion_tokens is not None:
        body["usage"] = usage(prompt_tokens, completion_tokens)
    return body


def chat_body(rid: str, model: str, text: str, finish: str | None, prompt_tokens: int,
              completion_tokens: int, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish}],
            "usage": usage(prompt_tokens, completion_tokens)}


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """FastAPI's validation errors → one line naming the field (or the JSON problem) and the parameter."""
    if not errors:
        return "the request body is invalid", None
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        ctx = err.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({ctx or err.get('msg')}); send a JSON object", None
    field = ".".join(loc) or "body"
    return f"{field}: {err.get('msg', 'invalid')}", (loc[0] if loc else None)
