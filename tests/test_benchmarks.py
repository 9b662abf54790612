"""Benchmark harness: scoring, task building and a --quick smoke run on the tiny model."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.ruler_tasks import build, score


def test_ruler_string_match():
    assert score("The numbers are 123 and 456.", ["123", "456"], "all") == 1.0
    assert score("Only 123.", ["123", "456"], "all") == 0.5
    assert score("It was the european court of justice", ["The European Court of Justice", "ECJ"], "part") == 1.0
    assert score("No idea", ["ECJ"], "part") == 0.0


@pytest.fixture(scope="module")
def count_words():
    return lambda text: len(text.split())


def test_tasks_are_reproducible_and_hold_their_needles(count_words):
    first = build(["niah_single_2", "niah_multikey_1", "qa_1"], [600], 1, count_words, seed=3)
    again = build(["niah_single_2", "niah_multikey_1", "qa_1"], [600], 1, count_words, seed=3)
    assert [c.document for c in first] == [c.document for c in again]
    for context in first:
        assert context.questions
        assert count_words(context.document) <= 700
        for q in context.questions:
            if q.metric == "all":
                assert all(ref in context.document for ref in q.refs)
            else:
                assert any(ref in context.document for ref in q.refs)


def test_quick_run_writes_results(tiny_model_dir, tmp_path, monkeypatch):
    from benchmarks import ruler

    argv = [
        "ruler",
        "--quick",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        "niah_single_1",
        "qa_1",
        "--out",
        str(tmp_path),
    ]
    monkeypatch.setattr(sys, "argv", argv)
    ruler.main()
    rows = [json.loads(line) for line in (tmp_path / "ruler.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == set(ruler.OUR_METHODS)  # every method ran
    assert all(0 <= r["score"] <= 1 and r["kl"] >= -1e-6 for r in rows)
    assert all(r["kl"] == 0 for r in rows if r["method"] == "full")
    assert all(r["kv_bytes"] < r["full_kv_bytes"] for r in rows if r["method"] != "full")
    assert "| semanticache | 0.50 |" in (tmp_path / "ruler.md").read_text()
    assert (tmp_path / "ruler.png").stat().st_size > 1000
