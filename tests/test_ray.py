"""Ray Data bulk reading into a shared store and Ray Serve replicas answering from it (local Ray, 2 CPUs)."""

from __future__ import annotations

import socket
import time

import pytest

ray = pytest.importorskip("ray", reason='needs pip install "semanticache-rag[ray]"')
httpx = pytest.importorskip("httpx")

from ray import serve  # noqa: E402

from semanticache_rag import DocumentStore  # noqa: E402
from semanticache_rag.integrations.ray import AFFINITY_HEADER, DocumentServer, ReadDocuments  # noqa: E402

TEXTS = {
    "hall.txt": "The maintenance code for the north turbine hall is Q7-TANGERINE-318. " * 12,
    "licence.txt": "Permission is granted to copy and distribute this manual. " * 12,
}


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("shared") / "store"


@pytest.fixture(scope="module")
def bulk_rows(local_ray, store_dir, tiny_model_dir, tmp_path_factory):
    missing = tmp_path_factory.mktemp("inputs") / "missing.pdf"
    items = [{"text": text, "name": name, "path": None} for name, text in TEXTS.items()]
    return _read_all(store_dir, tiny_model_dir, [*items, {"text": "", "name": "", "path": str(missing)}])


def _read_all(store_dir, model_dir, items) -> list[dict]:
    rows = (
        ray.data.from_items(items)
        .map_batches(
            ReadDocuments,
            batch_size=1,
            concurrency=1,
            num_cpus=1,
            fn_constructor_kwargs={"store": str(store_dir), "model": str(model_dir), "ratio": 0.5},
        )
        .take_all()
    )
    return sorted(rows, key=lambda r: r["source"])


def test_ray_data_reads_each_document_into_the_store_and_reports_failures(bulk_rows, store_dir, tiny_model_dir):
    by_source = {r["source"]: r for r in bulk_rows}
    assert set(by_source) == {*TEXTS, str(next(s for s in by_source if s.endswith("missing.pdf")))}
    failed = next(r for s, r in by_source.items() if s.endswith("missing.pdf"))
    assert "missing.pdf" in failed["error"] and not failed["document_id"]
    for name in TEXTS:
        row = by_source[name]
        assert row["error"] == "" and len(row["document_id"]) == 16 and row["tokens"] > 100
        assert row["cache_bytes"] < row["full_bytes"] and not row["loaded"]
    store = DocumentStore(store_dir)
    assert len(store.entries()) == 2
    assert {store.find_upload(by_source[n]["document_id"]).name for n in TEXTS} == set(TEXTS)
    again = _read_all(store_dir, tiny_model_dir, [{"text": t, "name": n, "path": None} for n, t in TEXTS.items()])
    assert all(r["loaded"] and r["error"] == "" for r in again)  # a second job loads, never reads again
    assert len(store.entries()) == 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_ray_serve_replicas_answer_from_the_shared_store_with_document_affinity(bulk_rows, store_dir, tiny_model_dir):
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = DocumentServer.options(num_replicas=2, ray_actor_options={"num_cpus": 0.5})
    serve.run(app.bind(store=str(store_dir), model=str(tiny_model_dir), ratio=0.5), name="documents")
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"
    replicas, answers = {}, {}
    for row in bulk_rows:
        if row["error"]:
            continue
        doc_id = row["document_id"]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "What is the code?"}], "document_id": doc_id}
        for attempt in range(6):
            if attempt == 1:  # the replica reports the document it registered; the proxy learns it asynchronously
                time.sleep(2)
            # a replica's first answer may build the CPU kernels (~1-2 min on 2 busy cores): a generous timeout
            response = httpx.post(
                f"{url}/v1/chat/completions", json=body, headers={AFFINITY_HEADER: doc_id}, timeout=240
            )
            assert response.status_code == 200, response.text
            reply = response.json()
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= row["tokens"]  # loaded, not read
            answers.setdefault(doc_id, set()).add(reply["choices"][0]["message"]["content"])
            replicas.setdefault(doc_id, []).append(response.headers["x-semanticache-replica"])
    assert all(len(a) == 1 for a in answers.values())  # greedy: every replica answers the same
    for served_by in replicas.values():
        assert len(set(served_by[1:])) == 1, served_by  # once the proxy knows, one replica serves it
    unknown = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "?"}], "document_id": "0" * 16},
        headers={AFFINITY_HEADER: "0" * 16},
        timeout=60,
    )
    assert unknown.status_code == 404 and "upload it" in unknown.text
    serve.delete("documents")
