"""The OpenAI-compatible server, run for real (uvicorn on a local port) and driven by the clients people use."""

from __future__ import annotations

import json
import socket
import threading
import time
from importlib import resources

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import httpx  # noqa: E402
import openai  # noqa: E402
import uvicorn  # noqa: E402
from conftest import corpus_text  # noqa: E402

from semanticache_rag import Engine  # noqa: E402
from semanticache_rag.server import Limits, create_app  # noqa: E402

DEMO_PDF = resources.files("semanticache_rag") / "data" / "cyrguide.pdf"
KEY = "test-key"


class Server:
    """uvicorn serving ``app`` on a free local port, in a thread."""

    def __init__(self, app):
        self.app = app
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def engine(tiny_llama, tiny_tokenizer):
    return Engine(tiny_llama, tiny_tokenizer, model_name="tiny", prefill_chunk=64, section_tokens=256)


@pytest.fixture(scope="module")
def server(engine):
    running = Server(create_app(engine, api_key=KEY, limits=Limits(upload_bytes=2**20, new_tokens=64, concurrent=1)))
    yield running
    running.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def http(server, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    return httpx.request(method, f"{server.url}{path}", headers=headers, timeout=60, **kwargs)


def uploaded(server, **kwargs) -> dict:
    """Upload a document and wait until it is read."""
    response = http(server, "POST", "/v1/documents", **kwargs)
    assert response.status_code == 202, response.text
    document = response.json()
    for _ in range(600):
        document = http(server, "GET", f"/v1/documents/{document['id']}").json()
        if document["status"] != "reading":
            return document
        time.sleep(0.05)
    raise AssertionError("the document was not read in time")


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_chat_streams_and_reports_cached_tokens(client):
    system = {"role": "system", "content": "Answer from this text.\n\n" + corpus_text()[:1500]}
    first = client.chat.completions.create(
        model="tiny", messages=[system, {"role": "user", "content": "Who may copy it?"}], max_tokens=8
    )
    assert first.choices[0].message.role == "assistant" and first.usage.completion_tokens >= 1
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[system, {"role": "user", "content": "What may be changed?"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens_details.cached_tokens > 300  # the same system message
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    again = client.chat.completions.create(
        model="tiny", messages=[system, {"role": "user", "content": "What may be changed?"}], max_tokens=8
    )
    assert again.choices[0].message.content == text.strip()


def test_completions_endpoint(client):
    out = client.completions.create(model="tiny", prompt="The licensee may", max_tokens=5)
    assert out.object == "text_completion" and out.usage.completion_tokens >= 1


def test_langchain_and_llama_index_clients_work_unchanged(server):
    from langchain_openai import ChatOpenAI
    from llama_index.llms.openai_like import OpenAILike

    chat = ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model="tiny", max_tokens=6, max_retries=0)
    message = chat.invoke("Who may copy the program?")
    assert isinstance(message.content, str) and message.usage_metadata["output_tokens"] >= 1
    assert "".join(chunk.content for chunk in chat.stream("Who may copy it?")) is not None
    llm = OpenAILike(api_base=f"{server.url}/v1", api_key=KEY, model="tiny", is_chat_model=True, max_tokens=6)
    assert llm.complete("Who may copy it?").text is not None
    assert "".join(r.delta for r in llm.stream_complete("Who may copy it?")) is not None


def test_a_document_is_uploaded_read_and_answered_with_its_pages(server, client):
    with resources.as_file(DEMO_PDF) as path:
        document = uploaded(server, files={"file": ("cyrguide.pdf", path.read_bytes(), "application/pdf")})
    assert document["status"] == "ready" and document["pages"] == 7 and document["tokens_read"] > 0
    assert document["sections"] > 1  # longer than the tiny model's context: read in sections
    listed = http(server, "GET", "/v1/documents").json()["data"]
    assert document["id"] in [d["id"] for d in listed]
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Which RFC specifies koi8-r?"}],
        max_tokens=6,
        extra_body={"document_id": document["id"]},
    )
    extras = answer.model_extra["semanticache"]
    assert extras["document_id"] == document["id"] and extras["pages"] and extras["routing"] == "bm25"
    assert answer.usage.prompt_tokens_details.cached_tokens > 100  # the document came from its cache
    completion = client.completions.create(
        model="tiny", prompt="Which RFC specifies koi8-r?", max_tokens=6, extra_body={"document_id": document["id"]}
    )
    assert completion.model_extra["semanticache"]["document_id"] == document["id"]
    assert completion.usage.prompt_tokens_details.cached_tokens > 100
    assert http(server, "DELETE", f"/v1/documents/{document['id']}").json()["deleted"] is True
    assert http(server, "GET", f"/v1/documents/{document['id']}").status_code == 404


def test_request_text_is_never_read_as_a_path(server, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("The secret word is swordfish.")
    document = uploaded(server, json={"text": str(secret), "name": "path.txt"})
    assert server.app.state.library.get(document["id"]).document.text == str(secret)  # the path's characters
    response = http(server, "POST", "/v1/documents", files={"file": (str(secret), b"plain words", "text/plain")})
    assert response.status_code == 202 and response.json()["name"] == "secret.txt"  # a name, never opened


@pytest.mark.parametrize(
    "method,path,kwargs,status,message",
    [
        ("POST", "/v1/chat/completions", {"content": b"{not json"}, 400, ""),
        ("POST", "/v1/chat/completions", {"json": {"messages": []}}, 400, "messages"),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "x"}], "n": 2}},
            400,
            "n=1",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 999}},
            400,
            "at most 64",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}},
            400,
            "tools",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}},
            400,
            "text only",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "x"}], "document_id": "0123456789abcdef"}},
            404,
            "no document",
        ),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "x"}], "document_id": "../etc"}},
            400,
            "document_id",
        ),
        (
            "POST",
            "/v1/documents",
            {"files": {"file": ("bad.pdf", b"%PDF-1.4 garbage", "application/pdf")}},
            400,
            "not a readable PDF",
        ),
        (
            "POST",
            "/v1/documents",
            {"content": b"x" * (2**20 + 10), "headers": {"content-type": "text/plain"}},
            413,
            "limit",
        ),
        ("POST", "/v1/documents", {"json": {"name": "no text"}}, 400, "text"),
        ("GET", "/v1/documents/0123456789abcdef", {}, 404, "no document"),
        ("DELETE", "/v1/documents/0123456789abcdef", {}, 404, "no document"),
    ],
)
def test_bad_requests_get_a_clear_4xx_and_change_nothing(server, method, path, kwargs, status, message):
    before = http(server, "GET", "/v1/documents").json()["data"]
    response = http(server, method, path, **kwargs)
    assert response.status_code == status, response.text
    assert message in response.json()["error"]["message"]
    assert http(server, "GET", "/v1/documents").json()["data"] == before


def test_an_api_key_is_required(server):
    response = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401


def test_a_client_that_goes_away_mid_stream_frees_its_slot(server, client):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me everything."}], "max_tokens": 60}
    body |= {"stream": True, "loop_guard": False}
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                json.loads(line[6:])
                break  # one chunk, then hang up
    answer = client.chat.completions.create(  # the server answers one request at a time: the slot came back
        model="tiny", messages=[{"role": "user", "content": "Who?"}], max_tokens=3, timeout=30
    )
    assert answer.usage.completion_tokens >= 1


def test_concurrent_clients_all_get_their_answers(server, client):
    results = {}

    def ask(i: int) -> None:
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Question {i}?"}], max_tokens=6, stream=True
        )
        results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == [0, 1, 2, 3]


def test_a_long_system_message_is_compressed_by_a_compressing_server(tiny_llama, tiny_tokenizer):
    from semanticache_rag import SemantiCacheCompressor
    from semanticache_rag.prompt_cache import PromptCache

    engine = Engine(tiny_llama, tiny_tokenizer, model_name="tiny", compressor=SemantiCacheCompressor(0.5))
    running = Server(create_app(engine, prompt_cache=PromptCache(engine, compress_messages_over=300)))
    try:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
        system = {"role": "system", "content": "Answer from this text.\n\n" + corpus_text()[:2500]}
        bodies = [
            client.chat.completions.create(
                model="tiny", messages=[system, {"role": "user", "content": q}], max_tokens=4
            ).model_dump()
            for q in ("Who may copy it?", "What may be changed?")
        ]
    finally:
        running.stop()
    first, second = (body["semanticache"] for body in bodies)
    assert first["document_id"] == second["document_id"] and first["document_id"].startswith("message-")
    assert first["cache_creation_tokens"] > 500 and second["cache_creation_tokens"] == 0
    assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 500
    assert second["entries_removed"] > 0.3  # the system message was compressed, not only cached


def test_servers_sharing_a_store_answer_about_each_others_uploads(tiny_llama, tiny_tokenizer, tmp_path):
    from semanticache_rag import DocumentStore

    def replica() -> tuple[Engine, Server]:
        engine = Engine(tiny_llama, tiny_tokenizer, model_name="tiny", store=DocumentStore(tmp_path / "store"))
        return engine, Server(create_app(engine, api_key=KEY, limits=Limits(new_tokens=8)))

    (first_engine, first), (second_engine, second) = replica(), replica()
    try:
        text = "The maintenance code for the north turbine hall is Q7-TANGERINE-318. " * 20
        document = uploaded(first, json={"text": text, "name": "hall.txt"})
        assert document["status"] == "ready" and first_engine.store.stats.misses == 1
        asked = {"messages": [{"role": "user", "content": "What is the code?"}], "document_id": document["id"]}
        answers = [
            http(s, "POST", "/v1/chat/completions", json={"model": "tiny", **asked}).json() for s in (first, second)
        ]
        assert answers[1]["choices"][0]["message"] == answers[0]["choices"][0]["message"]
        assert answers[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
        assert second_engine.store.stats.misses == 0 and second_engine.store.stats.disk_hits == 1  # loaded, not read
        shown = http(second, "GET", f"/v1/documents/{document['id']}").json()
        assert shown["name"] == "hall.txt" and shown["status"] == "ready"
        for bad in ("../../etc/passwd", document["id"][:8], "g" * 16):
            assert http(second, "GET", f"/v1/documents/{bad}").status_code == 404
        assert http(second, "DELETE", f"/v1/documents/{document['id']}").json()["deleted"] is True
        _, third = replica()
        try:
            assert http(third, "GET", f"/v1/documents/{document['id']}").status_code == 404  # deleted for every replica
        finally:
            third.stop()
        assert list((tmp_path / "store").glob("*.safetensors"))  # the cache itself stays, for a re-upload
    finally:
        first.stop()
        second.stop()
