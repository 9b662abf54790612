"""The OpenAI wire format the server speaks: request models (validated) and response bodies.

Requests follow OpenAI's chat and completions APIs (what the ``openai`` client, LangChain's
``ChatOpenAI`` and LlamaIndex's ``OpenAILike`` send); fields they send that do not apply here
(``frequency_penalty``, ``user``, ...) are ignored, fields that would change the answer in a way
this server cannot honour (``n > 1``, tools, images) are refused. Extra fields, as vLLM takes
them through ``extra_body``: ``document_id`` (answer from an uploaded document's cache),
``repetition_penalty``, ``no_repeat_ngram_size``, ``loop_guard``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from semanticache_rag.errors import ConfigError

FINISH_REASONS = {"stop": "stop", "length": "length", "repetition": "stop"}  # OpenAI's names


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    document_id: str | None = Field(default=None, pattern=r"^[0-9a-f]{16}$")
    repetition_penalty: float | None = Field(default=None, gt=0)
    no_repeat_ngram_size: int | None = Field(default=None, ge=0)
    loop_guard: bool | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    def options(self, limit: int) -> dict:
        """Generation options of this request (greedy unless a temperature is given)."""
        max_new = self.max_completion_tokens or self.max_tokens or min(256, limit)
        if max_new > limit:
            raise ConfigError(f"max_tokens is {max_new}; this server answers with at most {limit} tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        options = {
            "max_new_tokens": max_new,
            "temperature": self.temperature or 0.0,
            "top_p": self.top_p or 1.0,
            "stop": tuple(stop),
            "seed": self.seed,
            "repetition_penalty": self.repetition_penalty,
            "no_repeat_ngram_size": self.no_repeat_ngram_size,
            "loop_guard": self.loop_guard,
        }
        return {k: v for k, v in options.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ConfigError(f"a {part.get('type')!r} content part: this server reads text only")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1)
    tools: list | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools: list | None) -> list | None:
        if tools:
            raise ValueError("tools are not supported")
        return tools

    def role_dicts(self) -> list[dict[str, str]]:
        roles = {"developer": "system"}
        return [{"role": roles.get(m.role, m.role), "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    prompt: str | list[str]

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ConfigError("send one prompt per request")
            return self.prompt[0]
        return self.prompt

    def role_dicts(self) -> list[dict[str, str]]:
        """The prompt as one user message (a completion about a document is one question)."""
        return [{"role": "user", "content": self.text()}]


def usage(answer) -> dict:
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": answer.completion_tokens,
        "total_tokens": answer.prompt_tokens + answer.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": answer.cached_tokens},
    }


def extras(answer) -> dict:
    """What this server adds to OpenAI's body: where the answer came from and what the cache did."""
    return {
        "document_id": answer.document_id,
        "pages": list(answer.pages),
        "sections": list(answer.sections),
        "sections_total": answer.sections_total,
        "routing": answer.routing,
        "routing_matched": answer.routing_matched,
        "finish_reason": answer.finish_reason,
        "cache_bytes": answer.cache_bytes,
        "entries_removed": answer.entries_removed,
        "bytes_removed": answer.bytes_removed,
        "cache_creation_tokens": answer.cache_creation_tokens,
        "prefill_s": answer.prefill_s,
        "decode_s": answer.decode_s,
    }


class Reply:
    """One answer's response objects: a whole body, or the chunks of a stream."""

    def __init__(self, model: str, chat: bool):
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.model, self.chat = int(time.time()), model, chat

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def body(self, answer) -> dict:
        finish = FINISH_REASONS.get(answer.finish_reason, "stop")
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": answer.answer}, "finish_reason": finish}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": answer.answer, "finish_reason": finish, "logprobs": None}
            kind = "text_completion"
        return self._base(kind) | {"choices": [choice], "usage": usage(answer), "semanticache": extras(answer)}

    def chunk(self, text: str | None = None, finish: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return self._base("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return self._base("text_completion") | {"choices": [choice]}

    def last_chunks(self, answer, include_usage: bool) -> list[dict]:
        finish = self.chunk(finish=FINISH_REASONS.get(answer.finish_reason, "stop"))
        finish["semanticache"] = extras(answer)
        if not include_usage:
            return [finish]
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return [finish, self._base(kind) | {"choices": [], "usage": usage(answer)}]


def error_body(message: str, kind: str = "invalid_request_error", code: str | None = None, param=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
