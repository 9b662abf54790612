"""An OpenAI-compatible server over one engine, with automatic prompt caching and uploaded documents.

Endpoints: ``POST /v1/chat/completions`` and ``/v1/completions`` (streaming with server-sent
events; usage reports ``prompt_tokens_details.cached_tokens``), ``GET /v1/models``, ``GET /health``,
and documents: ``POST /v1/documents`` (a PDF or text file as multipart ``file``, or JSON
``{"text", "name"}``), ``GET /v1/documents[/{id}]``, ``DELETE /v1/documents/{id}``. A chat request
with ``"document_id"`` (a completion request too: its prompt is the question) is answered from that
document's cache (any length); any other prompt goes through the prompt cache (registered
documents, then the longest prefix of a prompt seen before).
``GET /`` is the web page. FastAPI (with Starlette's streaming responses for the events) and
uvicorn: the stack llama.cpp-style OpenAI servers in Python use; nothing else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import logging
from importlib import resources

from fastapi import Depends, FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from semanticache_rag.documents import document_from_bytes, document_from_text
from semanticache_rag.errors import ConfigError, ContextLengthError, DocumentError, SemantiCacheError
from semanticache_rag.prompts import Turn
from semanticache_rag.server.documents import DocumentLibrary
from semanticache_rag.server.schema import ChatRequest, CompletionRequest, Reply, error_body

logger = logging.getLogger(__name__)

_DONE = object()
DOCUMENT_WAIT_S = 10.0  # a question about a document kept in the store waits this long for its cache to load


@dataclasses.dataclass
class Limits:
    """What one request may ask for (each refused with a 4xx error that says so)."""

    upload_bytes: int = 64 * 2**20
    pages: int = 2000
    new_tokens: int = 1024
    concurrent: int = 2  # answers computed at once; the others wait their turn, first come first served


class _Generation:
    """Text pieces of one answer, and the :class:`~semanticache_rag.Answer` once they are consumed."""

    def __init__(self, pieces, answer, document_id: str | None = None):
        self.pieces, self._answer, self.document_id = iter(pieces), answer, document_id

    def answer(self):
        answer = self._answer()
        return answer if self.document_id is None else dataclasses.replace(answer, document_id=self.document_id)


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def create_app(engine, *, api_key: str | None = None, prompt_cache=None, limits: Limits | None = None) -> FastAPI:
    """The server's ASGI app for ``engine`` (run it with uvicorn, or ``semanticache-rag serve``)."""
    from semanticache_rag.prompt_cache import PromptCache

    limits = limits or Limits()
    prompts = prompt_cache or PromptCache(engine)
    library = DocumentLibrary(engine)
    slots = asyncio.Semaphore(limits.concurrent)
    app = FastAPI(title="semanticache-rag", docs_url=None, redoc_url=None)
    app.state.library, app.state.prompt_cache = library, prompts

    def authorised(authorization: str | None = Header(default=None)) -> None:
        if api_key and not hmac.compare_digest(authorization or "", f"Bearer {api_key}"):
            raise HTTPException(401, "a valid API key is needed: send 'Authorization: Bearer <key>'")

    _errors(app)
    guarded = [Depends(authorised)]

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": engine.model_name, "documents": len(library.all())}

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return (resources.files("semanticache_rag.server") / "static" / "index.html").read_text()

    @app.get("/v1/models", dependencies=guarded)
    def models() -> dict:
        model = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "semanticache-rag"}
        return {"object": "list", "data": [model]}

    def prompted(prompt, options: dict) -> _Generation:
        stream = prompts.stream(prompt, **options)  # may prefill a registered document: in a worker thread
        return _Generation(stream, lambda: stream.answer)

    def generation(body: ChatRequest | CompletionRequest, prompt):
        options = body.options(limits.new_tokens)
        if body.document_id is not None:
            return functools.partial(_document_chat, engine, library, body, options)
        return functools.partial(prompted, prompt, options)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(body: ChatRequest):
        make = generation(body, body.role_dicts())
        return await _respond(make, Reply(engine.model_name, chat=True), body, slots)

    @app.post("/v1/completions", dependencies=guarded)
    async def complete(body: CompletionRequest):
        make = generation(body, body.text())
        return await _respond(make, Reply(engine.model_name, chat=False), body, slots)

    _document_routes(app, library, limits, guarded)
    return app


def _document_chat(engine, library, body: ChatRequest | CompletionRequest, options: dict) -> _Generation:
    """A request about an uploaded document: its messages (a completion's prompt: one question) as
    turns over the document's cache."""
    served = library.get(body.document_id, wait_s=DOCUMENT_WAIT_S)
    if served is None:
        raise HTTPException(404, f"no document {body.document_id}; upload it to /v1/documents first")
    if served.status != "ready":
        detail = served.error if served.status == "failed" else "it is still being read; ask again when it is ready"
        raise HTTPException(409, f"document {served.id} cannot answer yet: {detail}")
    messages = [m for m in body.role_dicts() if m["role"] != "system"]
    if not messages or messages[-1]["role"] != "user":
        raise ConfigError("the last message must be the user's question")
    turns, question = [], None
    for message in messages:
        if message["role"] == "user":
            if question is not None:
                turns.append(Turn(question, ""))
            question = message["content"]
        elif question is not None:
            turns.append(Turn(question, message["content"]))
            question = None
    conversation = engine.conversation(served.cache, **options)
    conversation.turns = turns
    return _Generation(conversation.stream(question), lambda: conversation.last_answer, served.id)


async def _respond(make, reply: Reply, body, slots: asyncio.Semaphore):
    """The whole answer, or its stream, computed in a slot. A stream's first piece is computed before
    the response starts, so that a request that cannot be answered (too long for the context, say)
    gets a 4xx error rather than a broken stream."""
    if not body.stream:
        async with slots:
            return JSONResponse(reply.body(await asyncio.to_thread(_answer, make)))
    await slots.acquire()  # released when the stream ends, however it ends
    try:
        generation = await asyncio.to_thread(make)
        first = await asyncio.to_thread(next, generation.pieces, _DONE)
    except BaseException:
        slots.release()
        raise
    events = _events(generation, reply, first, body.include_usage, slots)
    return StreamingResponse(events, media_type="text/event-stream")


def _answer(make):
    generation = make()
    for _ in generation.pieces:
        pass
    return generation.answer()


async def _events(generation: _Generation, reply: Reply, piece, include_usage: bool, slots: asyncio.Semaphore):
    """Server-sent events of one answer; a client that goes away frees its slot (``finally``)."""
    try:
        yield _event(reply.chunk(first=True))
        while piece is not _DONE:
            yield _event(reply.chunk(piece))
            piece = await asyncio.to_thread(next, generation.pieces, _DONE)
        for chunk in reply.last_chunks(generation.answer(), include_usage):
            yield _event(chunk)
        yield "data: [DONE]\n\n"
    except SemantiCacheError as exc:
        yield _event(error_body(str(exc)))
    finally:
        slots.release()


def _document_routes(app: FastAPI, library: DocumentLibrary, limits: Limits, guarded: list) -> None:
    @app.post("/v1/documents", dependencies=guarded, status_code=202)
    async def upload(request: Request) -> dict:
        document = await _uploaded(request, limits)
        if document.total_pages > limits.pages:
            raise HTTPException(413, f"{document.name} has {document.total_pages} pages; the limit is {limits.pages}")
        return library.add(document).to_dict()

    @app.get("/v1/documents", dependencies=guarded)
    def documents() -> dict:
        return {"object": "list", "data": [d.to_dict() for d in library.all()]}

    @app.get("/v1/documents/{doc_id}", dependencies=guarded)
    def document(doc_id: str) -> dict:
        served = library.get(doc_id)
        if served is None:
            raise HTTPException(404, f"no document {doc_id}")
        return served.to_dict()

    @app.delete("/v1/documents/{doc_id}", dependencies=guarded)
    def delete(doc_id: str) -> dict:
        if library.remove(doc_id) is None:
            raise HTTPException(404, f"no document {doc_id}")
        return {"id": doc_id, "object": "document", "deleted": True}


async def _uploaded(request: Request, limits: Limits):
    """The document of an upload: multipart ``file`` (PDF or text), or JSON ``{"text", "name"}``.

    Nothing in a request is ever read as a path: a file's bytes are parsed as they are, text is text.
    """
    declared = int(request.headers.get("content-length") or 0)
    if declared > limits.upload_bytes:
        raise HTTPException(413, f"the upload is {declared:,} bytes; the limit is {limits.upload_bytes:,}")
    kind = request.headers.get("content-type", "")
    if kind.startswith("multipart/form-data"):
        form = await request.form(max_files=1, max_fields=4)
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise HTTPException(400, "send the document as a multipart field named 'file'")
        data = await upload.read(limits.upload_bytes + 1)
        if len(data) > limits.upload_bytes:
            raise HTTPException(413, f"the upload is over the limit of {limits.upload_bytes:,} bytes")
        return await asyncio.to_thread(document_from_bytes, data, upload.filename or "upload")
    try:
        payload = json.loads(await request.body())
    except ValueError as exc:
        raise HTTPException(400, f"the body is not JSON: {exc}") from exc
    if not isinstance(payload, dict) or not isinstance(payload.get("text"), str):
        raise HTTPException(400, 'send {"text": "...", "name": "..."} or a multipart file')
    return document_from_text(payload["text"], name=str(payload.get("name") or "text")[:200])


def _errors(app: FastAPI) -> None:
    """Every error as OpenAI's error object, with the status code that says whose fault it was."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(error_body(f"{where}: {first.get('msg', 'invalid request')}", param=where), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "authentication_error" if exc.status_code == 401 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)

    @app.exception_handler(SemantiCacheError)
    async def bad_input(request: Request, exc: SemantiCacheError) -> JSONResponse:
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        status = 400 if isinstance(exc, (ConfigError, ContextLengthError, DocumentError)) else 500
        return JSONResponse(error_body(str(exc), code=code), status)
