"""Document cache store: round trips, fault injection, budgets, concurrency, path traversal (tiny models)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import types

import pytest
import torch
from tests_support import needs_default_model, planted_document

from semanticache_rag import (
    ConfigError,
    Engine,
    KaizenCompressor,
    NoCompression,
    SemantiCacheCompressor,
    StreamingLLMCompressor,
)
from semanticache_rag.cli import main
from semanticache_rag.compressors import make_compressor
from semanticache_rag.compressors.kaizen import layer_option
from semanticache_rag.documents import document_from_text
from semanticache_rag.errors import StoreError
from semanticache_rag.kv import SharedLayerKV
from semanticache_rag.store import DocumentStore, parse_bytes

QUESTION = "What may the licensee do?"


@pytest.fixture()
def store_dir(tmp_path):
    return tmp_path / "store"


def make_engine(model, tokenizer, store_dir, compressor=None, **store_options):
    store = DocumentStore(store_dir, **store_options)
    return Engine(model, tokenizer, model_name="tiny", prefill_chunk=64, compressor=compressor, store=store)


@pytest.fixture()
def engine(tiny_llama, tiny_tokenizer, store_dir):
    return make_engine(tiny_llama, tiny_tokenizer, store_dir)


def fresh(engine, **store_options):
    """The same model in a new store object on the same directory: nothing in memory (a new process)."""
    return make_engine(engine.model, engine.tokenizer, engine.store.directory, engine.compressor, **store_options)


def answer(engine, cache) -> str:
    return engine.ask(cache, QUESTION, max_new_tokens=8).answer


def entry_files(store_dir):
    return sorted(p.name for p in store_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def assert_same_cache(a, b):
    assert torch.equal(a.prefix_ids, b.prefix_ids) and torch.equal(a.token_pages, b.token_pages)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
        assert (x.sizes is None) == (y.sizes is None)
        assert x.sizes is None or torch.equal(x.sizes, y.sizes)
    assert (a.model_name, a.compressor, a.length, a.nbytes) == (b.model_name, b.compressor, b.length, b.nbytes)


# -- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "compressor", [NoCompression(), SemantiCacheCompressor(0.5), StreamingLLMCompressor(0.5)], ids=repr
)
def test_reload_gives_the_same_tensors_and_answers(tiny_model, tiny_tokenizer, store_dir, document_text, compressor):
    first = make_engine(tiny_model, tiny_tokenizer, store_dir, compressor)
    cache = first.read(document_text, progress=False)
    assert first.store.stats.misses == 1 and first.store.stats.writes == 1
    again = fresh(first)
    loaded = again.read(document_text, progress=False)
    assert (again.store.stats.disk_hits, again.store.stats.misses) == (1, 0)
    assert_same_cache(cache, loaded)
    assert loaded.document == cache.document
    assert answer(again, loaded) == answer(first, cache)


@pytest.mark.parametrize(
    "compressor",
    [
        KaizenCompressor(0.75, calibration=None),
        KaizenCompressor(0.9, calibration=None),
        make_compressor("kaizen+semanticache", 0.9),
    ],
    ids=repr,
)
def test_kaizen_layers_reload_coded_and_shared(tiny_llama, tiny_tokenizer, store_dir, document_text, compressor):
    first = make_engine(tiny_llama, tiny_tokenizer, store_dir, compressor)
    cache = first.read(document_text, progress=False)
    options = [layer_option(layer) for layer in cache.layers]
    assert set(options) - {"fp", "fp16"}, options  # the budget made some layers int8/int4/low-rank/shared
    loaded = fresh(first).read(document_text, progress=False)
    assert [layer_option(layer) for layer in loaded.layers] == options
    assert loaded.nbytes == cache.nbytes < 0.5 * cache.full_nbytes  # as small as stored, not decoded to full size
    assert_same_cache(cache, loaded)  # same decoded keys and values, sizes, bytes
    for a, b in zip(cache.layers, loaded.layers):
        if isinstance(a, SharedLayerKV):  # the same stored layer below, not a copy of it
            assert b.source is loaded.layers[cache.layers.index(a.source)]
    assert answer(fresh(first), loaded) == answer(first, cache)


def test_memory_hit_and_renamed_file(engine, document_text, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(document_text)
    b.write_text(document_text)
    first = engine.read(a, progress=False)
    assert engine.read(a, progress=False) is first
    renamed = engine.read(b, progress=False)  # same content: same entry, the caller's document
    assert renamed.document.name == "b.txt" and renamed.layers is first.layers
    assert engine.store.stats.memory_hits == 2 and len(entry_files(engine.store.directory)) == 2


def test_key_covers_model_compressor_prompt_and_chunking(tiny_tokenizer, store_dir):
    from conftest import _tiny_model

    doc = document_from_text("The licensee may copy the work.")
    llama = _tiny_model("llama", len(tiny_tokenizer))
    base = make_engine(llama, tiny_tokenizer, store_dir)
    others = [
        make_engine(llama, tiny_tokenizer, store_dir, SemantiCacheCompressor(0.5)),
        make_engine(llama, tiny_tokenizer, store_dir, SemantiCacheCompressor(0.75)),
        Engine(llama, tiny_tokenizer, model_name="tiny", prefill_chunk=32, store=base.store),
        Engine(llama, tiny_tokenizer, model_name="tiny", system_prompt="Be brief.", store=base.store),
        make_engine(_tiny_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer, store_dir),
    ]
    assert len({base.store.key(e, doc).id for e in [base, *others]}) == 6
    twin = make_engine(_tiny_model("llama", len(tiny_tokenizer)), tiny_tokenizer, store_dir)  # equal weights
    assert base.store.key(twin, doc) == base.store.key(base, doc) == base.store.key(fresh(base), doc)
    with torch.no_grad():
        twin.model.lm_head.weight[0, 0] += 1e-3
    assert base.store.key(make_engine(twin.model, tiny_tokenizer, store_dir), doc) != base.store.key(base, doc)
    assert base.store.key(base, document_from_text("Other text.")) != base.store.key(base, doc)


# -- fault injection ------------------------------------------------------------------------


def _truncate(manifest, tensors):
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])


def _flip(manifest, tensors):
    data = bytearray(tensors.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[-1] ^= 0x01
    tensors.write_bytes(bytes(data))


def _garbage_manifest(manifest, tensors):
    manifest.write_text('{"format": "semanticache-rag document cache", "format_version": 1, "key": ')


def _other_package_version(manifest, tensors):
    m = json.loads(manifest.read_text())
    m["key"]["package_version"] = "0.0.1"
    manifest.write_text(json.dumps(m))


def _other_format_version(manifest, tensors):
    m = json.loads(manifest.read_text())
    m["format_version"] = 99
    manifest.write_text(json.dumps(m))


def _wrong_checksum(manifest, tensors):
    m = json.loads(manifest.read_text())
    m["tensors"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(m))


def _missing_tensors(manifest, tensors):
    tensors.unlink()


def _bad_shapes_valid_checksum(manifest, tensors):
    """A well-formed file whose checksum matches but whose tensors do not fit the model."""
    import hashlib

    from safetensors.torch import load, save

    loaded = load(tensors.read_bytes())
    loaded["layers.1.keys"] = loaded["layers.1.keys"][..., :3].contiguous()
    data = save(loaded)
    tensors.write_bytes(data)
    m = json.loads(manifest.read_text())
    m["tensors"]["sha256"] = hashlib.sha256(data).hexdigest()
    manifest.write_text(json.dumps(m))


@pytest.mark.parametrize(
    "corrupt",
    [
        _truncate,
        _flip,
        _garbage_manifest,
        _other_package_version,
        _other_format_version,
        _wrong_checksum,
        _missing_tensors,
        _bad_shapes_valid_checksum,
    ],
)
def test_damaged_entry_is_reported_once_deleted_and_read_again(engine, document_text, caplog, corrupt):
    expected = answer(engine, engine.read(document_text, progress=False))
    manifest, tensors = engine.store._paths(engine.store.key(engine, document_from_text(document_text)).id)
    corrupt(manifest, tensors)
    again = fresh(engine)
    with caplog.at_level(logging.INFO, logger="semanticache_rag.store"):
        cache = again.read(document_text, progress=False)
    assert again.store.stats.rejected == 1 and again.store.stats.misses == 1
    assert sum("Ignoring stored cache" in r.message for r in caplog.records) == 1
    assert answer(again, cache) == expected
    third = fresh(engine)  # the damaged entry was replaced by a valid one
    third.read(document_text, progress=False)
    assert third.store.stats.disk_hits == 1


def _edit_layer_storage(edit):
    def corrupt(manifest, tensors):
        m = json.loads(manifest.read_text())
        edit(m["layer_storage"])
        manifest.write_text(json.dumps(m))

    return corrupt


def _first(storage, kind):
    return next(record for record in storage if record["kind"] == kind)


@pytest.mark.parametrize(
    "edit",
    [
        lambda storage: _first(storage, "shared").update(source=len(storage)),  # a layer above it
        lambda storage: _first(storage, "coded")["keys"].update(code="PickledTensor"),
        lambda storage: (
            _first(storage, "coded")["keys"].update(bits=3)
            if "bits" in _first(storage, "coded")["keys"]
            else _first(storage, "coded")["keys"].update(dtype="int64")
        ),
        lambda storage: _first(storage, "coded").update(kind="plain"),  # its tensors are codes, not keys
        lambda storage: storage.pop(),
    ],
    ids=["shared-above", "unknown-code", "bad-bits-or-dtype", "wrong-kind", "missing-layer"],
)
def test_damaged_coded_entry_is_read_again(tiny_llama, tiny_tokenizer, store_dir, document_text, caplog, edit):
    engine = make_engine(tiny_llama, tiny_tokenizer, store_dir, KaizenCompressor(0.9, calibration=None))
    test_damaged_entry_is_reported_once_deleted_and_read_again(engine, document_text, caplog, _edit_layer_storage(edit))


def test_entry_of_another_model_is_rejected(tiny_llama, tiny_tokenizer, store_dir, document_text, caplog):
    from conftest import _tiny_model

    llama = make_engine(tiny_llama, tiny_tokenizer, store_dir)
    other = make_engine(_tiny_model("qwen2", len(tiny_tokenizer)), tiny_tokenizer, store_dir)
    doc = document_from_text(document_text)
    llama.read(doc, progress=False)
    ours, theirs = (
        llama.store._paths(llama.store.key(llama, doc).id),
        other.store._paths(other.store.key(other, doc).id),
    )
    for src, dst in zip(ours, theirs):  # the Llama's files under the Qwen2 entry's name
        dst.write_bytes(src.read_bytes())
    cache = other.read(doc, progress=False)
    assert other.store.stats.rejected == 1 and "model" in caplog.text
    plain = Engine(other.model, tiny_tokenizer, model_name="tiny", prefill_chunk=64)
    assert_same_cache(cache, plain.read(doc, progress=False))


def test_undeletable_damaged_entry_is_reported_once(engine, document_text, caplog, monkeypatch):
    engine.read(document_text, progress=False)
    _, tensors = engine.store._paths(engine.store.key(engine, document_from_text(document_text)).id)
    _flip(None, tensors)
    again = fresh(engine, memory_budget_bytes=0)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("semanticache_rag.store.atomic_write", refuse)
    monkeypatch.setattr(type(tensors), "unlink", refuse)
    with caplog.at_level(logging.WARNING, logger="semanticache_rag.store"):
        first, second = (again.read(document_text, progress=False) for _ in range(2))
    assert again.store.stats.rejected == 1 and again.store.stats.misses == 2
    assert sum("Ignoring stored cache" in r.message for r in caplog.records) == 1
    assert sum("Cannot write" in r.message for r in caplog.records) == 1
    assert answer(again, first) == answer(again, second)


def test_unwritable_store_still_answers(engine, document_text, caplog, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("semanticache_rag.store.atomic_write", refuse)
    monkeypatch.setattr("semanticache_rag.store_format.FileLock", refuse)
    with caplog.at_level(logging.WARNING, logger="semanticache_rag.store"):
        for text in (document_text, document_text[:1000]):
            assert answer(engine, engine.read(text, progress=False))
    assert sum("Cannot write" in r.message for r in caplog.records) == 1
    assert not engine.store.directory.exists() or entry_files(engine.store.directory) == []


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="permissions do not bind root")
def test_read_only_directory(engine, document_text, caplog):
    expected = answer(engine, engine.read(document_text, progress=False))
    directory = engine.store.directory
    os.chmod(directory, 0o555)
    try:
        again = fresh(engine)
        assert answer(again, again.read(document_text, progress=False)) == expected
        assert again.store.stats.disk_hits == 1
        with caplog.at_level(logging.WARNING, logger="semanticache_rag.store"):
            again.read(document_text[:1000], progress=False)
        assert again.store.stats.misses == 1 and "Cannot write" in caplog.text
    finally:
        os.chmod(directory, 0o755)


def test_crash_between_tensor_file_and_manifest_leaves_nothing_loadable(engine, document_text, monkeypatch):
    real_replace = os.replace

    def crash_on_manifest(src, dst):
        if str(dst).endswith(".json"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr("semanticache_rag.store_format.os.replace", crash_on_manifest)
    expected = answer(engine, engine.read(document_text, progress=False))
    monkeypatch.setattr("semanticache_rag.store_format.os.replace", real_replace)
    assert engine.store.entries() == [] and not list(engine.store.directory.glob(".tmp-*"))
    again = fresh(engine)
    assert answer(again, again.read(document_text, progress=False)) == expected
    assert again.store.stats.misses == 1 and len(again.store.entries()) == 1


def test_leftovers_of_a_crashed_writer_are_removed(engine, document_text):
    engine.read(document_text, progress=False)
    directory = engine.store.directory
    (directory / ".tmp-half.tmp").write_bytes(b"\0" * 100)
    (directory / f"{'a' * 64}.safetensors").write_bytes(b"\0" * 100)  # tensors whose manifest never came
    engine.store._remove_leftovers(3600)
    assert len(entry_files(directory)) == 3  # recent: maybe a writer at work
    engine.store._remove_leftovers(0)
    assert len(entry_files(directory)) == 2 and not (directory / ".tmp-half.tmp").exists()


# -- extracted text -------------------------------------------------------------------------


def test_reopened_file_skips_text_extraction(store_dir, tmp_path, monkeypatch, caplog):
    from importlib import resources

    store = DocumentStore(store_dir)
    with resources.as_file(resources.files("semanticache_rag") / "data" / "cyrguide.pdf") as pdf:
        data = pdf.read_bytes()
    first_path, second_path = tmp_path / "guide.pdf", tmp_path / "renamed.pdf"
    first_path.write_bytes(data)
    second_path.write_bytes(data)
    first = store.load_document(first_path)

    def no_extraction(source):
        raise AssertionError("extracted again")

    monkeypatch.setattr("semanticache_rag.store_documents.load_document", no_extraction)
    again = DocumentStore(store_dir).load_document(str(second_path))
    assert (again.text, again.pages, again.sha256, again.extractor) == (
        first.text,
        first.pages,
        first.sha256,
        first.extractor,
    )
    assert again.name == "renamed.pdf" and again.source == str(second_path.resolve())
    monkeypatch.undo()
    (record,) = (store_dir / "documents").iterdir()
    record.write_text(record.read_text().replace("Cyrillic", "Latin", 1))  # text no longer matches its hash
    with caplog.at_level(logging.WARNING, logger="semanticache_rag.store"):
        assert DocumentStore(store_dir).load_document(first_path) == first
    assert "Ignoring the stored text of guide.pdf" in caplog.text
    first_path.write_bytes(data + b"\n")  # other bytes: another record
    store.load_document(first_path)
    assert len(list((store_dir / "documents").iterdir())) == 2


def test_text_and_documents_are_not_recorded(store_dir, document_text):
    store = DocumentStore(store_dir)
    doc = document_from_text(document_text)
    assert store.load_document(doc) is doc and store.load_document(document_text) == doc
    assert not store_dir.exists()


# -- budgets --------------------------------------------------------------------------------


def test_disk_budget_evicts_least_recently_used(engine, document_text):
    texts = [document_text[i * 800 : (i + 1) * 800] for i in range(3)]
    engine.read(texts[0], progress=False)
    size = engine.store.disk_bytes
    budget_engine = fresh(engine, disk_budget_bytes=int(2.5 * size))
    for text in texts:
        budget_engine.read(text, progress=False)
        time.sleep(0.02)  # distinct last-use times
    kept = {e.manifest["key"]["document_sha256"] for e in budget_engine.store.entries()}
    assert kept == {document_from_text(t).sha256 for t in texts[1:]}
    assert budget_engine.store.disk_bytes <= 2.5 * size


def test_entry_larger_than_the_disk_budget_is_not_kept(engine, document_text, caplog):
    small = fresh(engine, disk_budget_bytes="1K")
    with caplog.at_level(logging.WARNING, logger="semanticache_rag.store"):
        cache = small.read(document_text, progress=False)
    assert small.store.entries() == [] and "exceeds the disk budget" in caplog.text
    assert small.read(document_text, progress=False) is cache  # still served from memory


def test_memory_budget_keeps_disk_copies(engine, document_text):
    a, b = document_text[:1500], document_text[1500:]
    size = engine.read(a, progress=False).nbytes
    small = fresh(engine, memory_budget_bytes=int(1.5 * size))
    small.read(a, progress=False)
    small.read(b, progress=False)
    assert small.store.memory_bytes <= 1.5 * size
    small.read(a, progress=False)  # evicted from memory: loaded from disk
    assert (small.store.stats.disk_hits, small.store.stats.memory_hits) == (2, 0)


def test_budgets_parse_and_validate(store_dir, monkeypatch):
    assert parse_bytes("2G") == 2 * 2**30 and parse_bytes("512MiB") == 512 * 2**20 and parse_bytes("1000") == 1000
    monkeypatch.setenv("SEMANTICACHE_DISK_BUDGET", "3G")
    assert DocumentStore(store_dir).disk_budget_bytes == 3 * 2**30
    with pytest.raises(ConfigError, match="size"):
        DocumentStore(store_dir, memory_budget_bytes="lots")
    with pytest.raises(ConfigError, match=">= 0"):
        DocumentStore(store_dir, disk_budget_bytes=-1)


# -- ids and paths --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad", ["../x", "/etc/passwd", "abcd/../..", "abc", "g" * 64, "0" * 64 + "/x", "..", "0000\0", "0" * 65, ""]
)
def test_ids_that_are_not_hex_are_rejected(engine, document_text, bad):
    engine.read(document_text, progress=False)
    for call in (engine.store.resolve, engine.store.info, engine.store.remove):
        with pytest.raises(ConfigError, match="invalid cache id"):
            call(bad)
    with pytest.raises(ConfigError):
        engine.store._paths(bad)
    assert len(engine.store.entries()) == 1


def test_document_names_never_become_paths(engine, tmp_path):
    doc = document_from_text("Some text to read.", name="../../escape.json", source="/etc/passwd")
    engine.read(doc, progress=False)
    (entry,) = engine.store.entries()
    assert entry.manifest["document"]["name"] == "../../escape.json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_prefix_resolution_and_removal(engine, document_text):
    engine.read(document_text[:900], progress=False)
    engine.read(document_text[900:1800], progress=False)
    first, second = (e.id for e in engine.store.entries())
    assert engine.store.resolve(first[:12].upper()) == first
    with pytest.raises(StoreError, match="no cache entry"):
        engine.store.resolve("ffff" if not first.startswith("ffff") else "eeee")
    twin = first[:6] + ("0" if first[6] != "0" else "1") + first[7:]  # an entry sharing first's 6 leading digits
    (engine.store.directory / f"{twin}.json").write_text("{}")
    with pytest.raises(StoreError, match="2 cache entries"):
        engine.store.resolve(first[:6])
    assert engine.store.resolve(first[:7]) == first
    engine.store.remove(twin)
    assert engine.store.remove(first[:8]).id == first
    assert [e.id for e in engine.store.entries()] == [second]
    assert engine.store.clear()[0] == 1 and engine.store.entries() == []


# -- zoom state (compressors that re-expand spans per question) -------------------------------


class FakeSpanIndex:
    def __init__(self, state):
        self.state = state

    nbytes = 8

    def state_dict(self):
        return self.state

    @classmethod
    def from_state_dict(cls, state):
        return cls(dict(state))

    def check(self, layers):
        pass


def with_zoom(engine, doc, state):
    """What a zooming compressor's read computes: a cache with host-side span state."""
    import dataclasses

    return lambda sections: dataclasses.replace(
        engine.compress(engine.prefill(doc, progress=False)), zoom=FakeSpanIndex(state)
    )


def test_zoom_state_round_trip_and_unavailable_zoom(engine, document_text, monkeypatch):
    module = types.ModuleType("semanticache_rag.compressors.sekv")
    module.zoom_from_state_dict = FakeSpanIndex.from_state_dict
    monkeypatch.setitem(sys.modules, "semanticache_rag.compressors.sekv", module)
    state = {"spans": torch.arange(6).reshape(3, 2), "low_rank.keys": torch.randn(2, 4)}
    doc = document_from_text(document_text)
    compute = with_zoom(engine, doc, state)
    engine.store.fetch(engine, doc, compute)
    loaded = fresh(engine).store.fetch(engine, doc, compute)
    assert isinstance(loaded.zoom, FakeSpanIndex) and loaded.zoom.state.keys() == state.keys()
    assert all(torch.equal(loaded.zoom.state[k], v) for k, v in state.items())
    monkeypatch.setitem(sys.modules, "semanticache_rag.compressors.sekv", None)  # the import fails
    again = fresh(engine)
    again.store.fetch(engine, doc, compute)
    assert again.store.stats.rejected == 1 and again.store.stats.misses == 1


def test_zoom_state_that_is_not_tensors_is_not_stored(engine, document_text, caplog):
    doc = document_from_text(document_text)
    compute = with_zoom(engine, doc, {"rank": 32})
    with caplog.at_level(logging.WARNING, logger="semanticache_rag.store"):
        engine.store.fetch(engine, doc, compute)
    assert engine.store.entries() == [] and "Cannot store" in caplog.text


@pytest.mark.parametrize("summary", ["spans", "cores"])
def test_sekv_cache_round_trip(tiny_llama, tiny_tokenizer, store_dir, document_text, summary):
    from semanticache_rag.compressors import sekv

    first = make_engine(tiny_llama, tiny_tokenizer, store_dir, sekv.SeKVCompressor(summary=summary))
    cache = first.read(document_text, progress=False)
    again = fresh(first)
    loaded = again.read(document_text, progress=False)
    kind = sekv.SpanIndex if summary == "spans" else sekv.CoreIndex
    assert again.store.stats.disk_hits == 1 and isinstance(loaded.zoom, kind)
    assert loaded.zoom.nbytes == cache.zoom.nbytes
    assert answer(again, loaded) == answer(first, cache)


# -- model identity -------------------------------------------------------------------------


def test_model_loaded_from_a_folder_is_identified_by_its_files(tiny_model_dir, store_dir):
    first = Engine.from_pretrained(str(tiny_model_dir), store=DocumentStore(store_dir))
    second = Engine.from_pretrained(str(tiny_model_dir), store=DocumentStore(store_dir))
    doc = document_from_text("Text.")
    assert first.store.key(first, doc) == second.store.key(second, doc)
    memo = json.loads((store_dir / "weights.json").read_text())
    assert [os.path.basename(k) for k in memo] == ["model.safetensors"]


# -- processes ------------------------------------------------------------------------------

CONCURRENT_READER = r"""
import json, pathlib, sys, time
from semanticache_rag import Engine
from semanticache_rag.store import DocumentStore

model_dir, store_dir, document, barrier, me, question = sys.argv[1:]
engine = Engine.from_pretrained(model_dir, store=DocumentStore(store_dir), prefill_chunk=64)
compress = engine.compress
def slow_compress(*args, **kwargs):  # a long read: the other process must wait for it
    time.sleep(1.5)
    return compress(*args, **kwargs)
engine.compress = slow_compress
pathlib.Path(barrier, me).touch()
while len(list(pathlib.Path(barrier).iterdir())) < 2:
    time.sleep(0.01)
cache = engine.read(document, progress=False)
answer = engine.ask(cache, question, max_new_tokens=8).answer
print(json.dumps({"answer": answer, "stats": vars(engine.store.stats)}))
"""


def test_two_processes_reading_one_new_document_make_one_entry(tiny_model_dir, store_dir, tmp_path, document_text):
    document = tmp_path / "doc.txt"
    document.write_text(document_text)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    args = [str(tiny_model_dir), str(store_dir), str(document), str(barrier)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_READER, *args, me, QUESTION], stdout=subprocess.PIPE, text=True
        )
        for me in ("a", "b")
    ]
    results = [json.loads(p.communicate(timeout=300)[0].splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    reference = Engine.from_pretrained(str(tiny_model_dir), prefill_chunk=64)
    expected = answer(reference, reference.read(document, progress=False))
    assert [r["answer"] for r in results] == [expected, expected]
    assert sorted((r["stats"]["misses"], r["stats"]["disk_hits"]) for r in results) == [(0, 1), (1, 0)]
    assert len(DocumentStore(store_dir).entries()) == 1


# -- command line ---------------------------------------------------------------------------


def test_cli_reuses_the_store_and_manages_it(tiny_model_dir, store_dir, tmp_path, document_text, capsys):
    document = tmp_path / "doc.txt"
    document.write_text(document_text)
    ask = ["ask", str(document), "-q", "Who?", "--model", str(tiny_model_dir), "--max-new-tokens", "3"]
    assert main([*ask, "--store", str(store_dir)]) == 0
    first = capsys.readouterr()
    assert "Read doc.txt" in first.err
    assert main([*ask, "--store", str(store_dir)]) == 0
    second = capsys.readouterr()
    answer_line = [line for line in first.out.splitlines() if line.startswith("A: ")]
    assert "Loaded the stored cache of doc.txt" in second.err and answer_line[0] in second.out.splitlines()
    assert main([*ask, "--store", str(tmp_path / "unused"), "--no-store"]) == 0
    assert not (tmp_path / "unused").exists() and answer_line[0] in capsys.readouterr().out.splitlines()

    assert main(["cache", "list", "--store", str(store_dir), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["document"] == "doc.txt" and row["pages"] == 1 and row["tokens"] > 0 and row["compressed_bytes"] > 0
    assert (
        row["entries_removed"] == row["bytes_removed"] == 0
        and row["model"] == str(tiny_model_dir)
        and row["last_used"] >= row["created"]
    )
    assert main(["cache", "list", "--store", str(store_dir)]) == 0
    out = capsys.readouterr().out
    assert row["id"][:12] in out and "doc.txt" in out and "1 entry," in out
    assert main(["cache", "info", row["id"][:6], "--store", str(store_dir)]) == 0
    assert row["id"] in capsys.readouterr().out
    assert main(["cache", "rm", "../../etc", "--store", str(store_dir)]) == 2
    assert "invalid cache id" in capsys.readouterr().err
    assert main(["cache", "rm", row["id"][:6], "--store", str(store_dir)]) == 0
    assert main(["cache", "info", row["id"][:6], "--store", str(store_dir)]) == 2
    assert main(["cache", "clear", "--store", str(store_dir)]) == 0
    assert "Removed 0 entries" in capsys.readouterr().out


# -- the real default model -----------------------------------------------------------------

RELOADER = r"""
import json, sys, time
from semanticache_rag import Engine
from semanticache_rag.store import DocumentStore

store_dir, document, questions = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
engine = Engine.from_pretrained(store=DocumentStore(store_dir))
started = time.perf_counter()
cache = engine.read(document, progress=False)
read_s = time.perf_counter() - started
answers = [engine.ask(cache, q, max_new_tokens=24).answer for q in questions]
print(json.dumps({"read_s": read_s, "answers": answers, "disk_hits": engine.store.stats.disk_hits}))
"""


@pytest.mark.slow
@needs_default_model
def test_default_model_reload_in_a_fresh_process(tmp_path):
    engine = Engine.from_pretrained(store=DocumentStore(tmp_path / "store"))
    text, question, expected = planted_document(tokens=2500, tokenizer=engine.tokenizer)
    document = tmp_path / "doc.txt"
    document.write_text(text)
    questions = [question, "What does the license say about warranties?"]
    started = time.perf_counter()
    cache = engine.read(document, progress=False)
    first_s = time.perf_counter() - started
    answers = [engine.ask(cache, q, max_new_tokens=24).answer for q in questions]
    assert expected in answers[0] and cache.length > 2400
    out = subprocess.run(
        [sys.executable, "-c", RELOADER, str(tmp_path / "store"), str(document), json.dumps(questions)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    reloaded = json.loads(out.stdout.splitlines()[-1])
    assert reloaded["disk_hits"] == 1
    assert reloaded["answers"] == answers
    print(
        f"\n{cache.length:,} tokens: first read {first_s:.1f}s, reload in a fresh process {reloaded['read_s']:.2f}s "
        f"({first_s / reloaded['read_s']:.0f}x)"
    )


def test_listing_reports_entries_and_bytes_removed_apart(tiny_llama, tiny_tokenizer, store_dir, document_text, capsys):
    """A KV-Kaizen cache keeps every entry and stores it smaller: 0% of entries, ~75% of bytes removed."""
    engine = make_engine(tiny_llama, tiny_tokenizer, store_dir, KaizenCompressor(0.75, calibration=None))
    cache = engine.read(document_text, progress=False)
    assert cache.entries_removed == 0 and 0.7 <= cache.bytes_removed <= 0.8
    assert main(["cache", "list", "--store", str(store_dir), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["entries_removed"] == 0 and row["bytes_removed"] == pytest.approx(cache.bytes_removed)
    answer = engine.ask(cache, QUESTION, max_new_tokens=2)
    assert answer.entries_removed == 0 and answer.bytes_removed == pytest.approx(cache.bytes_removed)


def test_entries_are_written_and_read_without_a_serialised_copy_in_memory(engine, document_text, monkeypatch):
    """Tensors go to the file from their own memory and come back one at a time (no bytes of the whole entry)."""
    import safetensors.torch

    def whole_entry_in_memory(*args, **kwargs):
        raise AssertionError("the entry was serialised in memory")

    monkeypatch.setattr(safetensors.torch, "save", whole_entry_in_memory)
    monkeypatch.setattr(safetensors.torch, "load", whole_entry_in_memory)
    cache = engine.read(document_text, progress=False)
    again = fresh(engine)
    assert_same_cache(cache, again.read(document_text, progress=False))
    assert again.store.stats.disk_hits == 1


def test_kept_uploads_are_found_by_id_and_a_damaged_one_is_left_in_place(tmp_path, caplog):
    store = DocumentStore(tmp_path / "store")
    document = document_from_text("The maintenance code is Q7-TANGERINE-318.\n" * 3, name="hall.txt")
    store.keep_upload(document)
    found = store.find_upload(document.sha256[:16])
    assert found.text == document.text and found.name == "hall.txt" and found.sha256 == document.sha256
    for bad in ("../" * 5 + "etc", document.sha256[:8], document.sha256[:16].upper(), None):
        assert store.find_upload(bad) is None
    record = tmp_path / "store" / "documents" / "uploads" / f"{document.sha256}.json"
    damaged = record.read_text().replace("TANGERINE", "TANGELO")
    record.write_text(damaged)
    with caplog.at_level(logging.WARNING):
        assert store.find_upload(document.sha256[:16]) is None
    assert "does not match its checksum" in caplog.text
    assert record.read_text() == damaged  # the user's text is never deleted for failing a check
    store.forget_upload(document)
    assert not record.exists()


def test_sekv_zoom_state_that_does_not_fit_its_layers_is_rejected(tiny_llama, tiny_tokenizer, store_dir, document_text):
    import hashlib

    from safetensors.torch import load, save

    from semanticache_rag import SeKVCompressor

    first = make_engine(tiny_llama, tiny_tokenizer, store_dir, SeKVCompressor())
    expected = answer(first, first.read(document_text, progress=False))
    manifest, tensors = first.store._paths(first.store.key(first, document_from_text(document_text)).id)
    loaded = load(tensors.read_bytes())
    loaded["zoom.entry_chunk.0"] = loaded["zoom.entry_chunk.0"][:, :-1].contiguous()  # one core short
    data = save(loaded)
    tensors.write_bytes(data)
    m = json.loads(manifest.read_text())
    m["tensors"]["sha256"] = hashlib.sha256(data).hexdigest()  # consistent bytes, inconsistent content
    manifest.write_text(json.dumps(m))
    again = fresh(first)
    cache = again.read(document_text, progress=False)
    assert again.store.stats.rejected == 1 and again.store.stats.misses == 1
    assert answer(again, cache) == expected
