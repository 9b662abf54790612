"""The document store with long documents: one file per section, resumed reads, budgets, damage (tiny models)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import corpus_text

from semanticache_rag import Engine, SectionedCache, StreamingLLMCompressor
from semanticache_rag.cli import main
from semanticache_rag.errors import StoreError
from semanticache_rag.store import DocumentStore

QUESTION = "What does the license say about patent claims?"


def make_engine(model, tokenizer, directory, compressor=None, **store_options):
    store = DocumentStore(directory, **store_options)
    return Engine(
        model, tokenizer, model_name="tiny", prefill_chunk=64, section_tokens=256, compressor=compressor, store=store
    )


@pytest.fixture()
def long_text() -> str:
    return corpus_text()[:12000]  # ~6K tokens of the tiny tokenizer: three times its context


@pytest.fixture()
def engine(tiny_llama, tiny_tokenizer, tmp_path):
    return make_engine(tiny_llama, tiny_tokenizer, tmp_path / "store", StreamingLLMCompressor(0.5))


def fresh(engine, **store_options):
    return make_engine(engine.model, engine.tokenizer, engine.store.directory, engine.compressor, **store_options)


def sections_folder(engine, text):
    from semanticache_rag.documents import document_from_text

    entry_id = engine.store.key(engine, document_from_text(text)).id
    return engine.store.directory / f"{entry_id}.sections", entry_id


def assert_same_sections(a: SectionedCache, b: SectionedCache) -> None:
    assert a.spans == b.spans and len(a.sections) == len(b.sections)
    for x, y in zip((a.head, *a.sections), (b.head, *b.sections)):
        assert torch.equal(x.prefix_ids, y.prefix_ids)
        for p, q in zip(x.layers, y.layers):
            assert torch.equal(p.keys, q.keys) and torch.equal(p.values, q.values)


def test_a_long_document_is_stored_per_section_and_reloads(engine, long_text):
    cache = engine.read(long_text, progress=False)
    assert isinstance(cache, SectionedCache)
    folder, entry_id = sections_folder(engine, long_text)
    assert len(list(folder.glob("*.safetensors"))) == len(cache.sections)
    again = fresh(engine)
    loaded = again.read(long_text, progress=False)
    assert again.store.stats.disk_hits == 1 and again.store.stats.misses == 0
    assert_same_sections(cache, loaded)
    first, second = (e.ask(c, QUESTION, max_new_tokens=6) for e, c in ((engine, cache), (again, loaded)))
    assert first.completion_ids == second.completion_ids and first.sections == second.sections
    (entry,) = again.store.entries()
    assert entry.id == entry_id and entry.manifest["tokens"] == cache.length
    assert entry.disk_bytes >= cache.nbytes  # the section files are counted
    again.store.remove(entry_id[:8])
    assert not folder.exists() and again.store.entries() == []


def test_an_interrupted_read_resumes_from_its_finished_sections(engine, long_text, monkeypatch):
    reads = []
    original = StreamingLLMCompressor.compress_cache

    def interrupted(self, keys_values, context):
        reads.append(context.token_ids.numel())
        if len(reads) == 4:
            raise KeyboardInterrupt
        return original(self, keys_values, context)

    monkeypatch.setattr(StreamingLLMCompressor, "compress_cache", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.read(long_text, progress=False)
    folder, _ = sections_folder(engine, long_text)
    assert engine.store.entries() == [] and len(list(folder.glob("*.safetensors"))) == 3  # no entry, 3 sections
    again = fresh(engine)
    cache = again.read(long_text, progress=False)
    assert len(reads) == 4 + len(cache.sections) - 3  # only the sections not finished before
    monkeypatch.setattr(StreamingLLMCompressor, "compress_cache", original)
    plain = make_engine(engine.model, engine.tokenizer, engine.store.directory.parent / "other", engine.compressor)
    assert_same_sections(cache, plain.read(long_text, progress=False))


def test_leftover_sections_of_an_abandoned_read_are_removed(engine, long_text, monkeypatch):
    engine.read(long_text, progress=False)
    folder, entry_id = sections_folder(engine, long_text)
    (engine.store.directory / f"{entry_id}.json").unlink()  # as if the read had never finished
    engine.store.clear()
    assert not folder.exists()


def test_cleanup_leaves_the_sections_of_a_read_under_way(engine, long_text):
    from filelock import FileLock

    engine.read(long_text, progress=False)
    folder, entry_id = sections_folder(engine, long_text)
    (engine.store.directory / f"{entry_id}.json").unlink()  # unfinished, as while it is being read
    reader = FileLock(engine.store._lock_path(entry_id))  # another process reading it
    with reader:
        engine.store._remove_leftovers(0)
        assert folder.exists()
    engine.store._remove_leftovers(0)
    assert not folder.exists()


@pytest.mark.parametrize("damaged", ["section", "head"])
def test_only_what_is_damaged_is_read_again(engine, long_text, caplog, monkeypatch, damaged):
    """A damaged section: that section alone is read again. A damaged head (or manifest): the head is
    read again and every section is loaded from its own checked file."""
    expected = engine.ask(engine.read(long_text, progress=False), QUESTION, max_new_tokens=6).completion_ids
    folder, entry_id = sections_folder(engine, long_text)
    victim = folder / "2.safetensors" if damaged == "section" else engine.store.directory / f"{entry_id}.safetensors"
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0xFF
    victim.write_bytes(bytes(data))
    reads = []
    original = StreamingLLMCompressor.compress_cache
    monkeypatch.setattr(
        StreamingLLMCompressor, "compress_cache", lambda self, *a: reads.append(1) or original(self, *a)
    )
    again = fresh(engine)
    cache = again.read(long_text, progress=False)
    assert again.store.stats.rejected == 1 and again.store.stats.misses == 1 and "checksum" in caplog.text
    assert len(reads) == (1 if damaged == "section" else 0)  # the intact sections were loaded, not read again
    assert again.ask(cache, QUESTION, max_new_tokens=6).completion_ids == expected
    third = fresh(engine)
    third.read(long_text, progress=False)
    assert third.store.stats.disk_hits == 1 and third.store.stats.rejected == 0


def test_an_entry_that_fails_for_another_reason_is_kept(engine, long_text, monkeypatch, caplog):
    engine.read(long_text, progress=False)
    folder, entry_id = sections_folder(engine, long_text)
    files = sorted(p.name for p in folder.iterdir())

    def broken(*args, **kwargs):
        raise MemoryError("no room to load it")

    monkeypatch.setattr("semanticache_rag.store.load_sectioned", broken)
    again = fresh(engine)
    cache = again.read(long_text, progress=False)
    assert isinstance(cache, SectionedCache) and again.store.stats.misses == 1
    assert "is kept" in caplog.text and sorted(p.name for p in folder.iterdir()) == files
    assert (engine.store.directory / f"{entry_id}.json").exists()


def test_a_document_too_long_for_the_disk_budget_is_refused_before_reading(engine, long_text, monkeypatch):
    small = fresh(engine, disk_budget_bytes="1M")
    calls = []
    monkeypatch.setattr(small, "forward", lambda *a, **k: calls.append(a))
    with pytest.raises(StoreError, match=r"would take about .* MiB, more than .* disk budget of 1 MiB"):
        small.read(long_text, progress=False)
    assert not calls


def test_cli_answers_a_long_document_with_its_pages(tiny_model_dir, tmp_path, long_text, capsys):
    document = tmp_path / "long.txt"
    document.write_text(long_text)
    args = ["ask", str(document), "-q", QUESTION, "--model", str(tiny_model_dir), "--max-new-tokens", "4"]
    assert main([*args, "--json", "--store", str(tmp_path / "store"), "--section-tokens", "256"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["pages"] == ["1"] and row["sections"] and row["sections_total"] > len(row["sections"])
    assert row["routing"] == "bm25" and row["routing_matched"] is True
