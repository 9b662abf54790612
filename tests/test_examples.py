"""The examples run offline as written, with the default model, and find the planted facts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests_support import needs_default_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

pytestmark = [
    pytest.mark.slow,
    needs_default_model,
]


def run_example(name: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=1200, cwd=EXAMPLES.parent
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def reused_counts(output: str, pattern: str) -> list[int]:
    return [int(n.replace(",", "")) for n in re.findall(pattern, output)]


def test_langchain_pdf_chain():
    pytest.importorskip("langchain_core")
    out = run_example("langchain_pdf_chain.py")
    assert "3.20" in out
    read = reused_counts(out, r"([\d,]+) read from cache")
    assert len(read) == 3 and read[0] == 0 and read[1] == read[2] > 4000


def test_llama_index_query():
    pytest.importorskip("llama_index.core")
    out = run_example("llama_index_query.py")
    summary, document = out.split("== DocumentQueryEngine ==")
    assert "3.20" in summary and "3.20" in document
    read = reused_counts(summary, r"([\d,]+) read from cache")
    assert len(read) == 2 and read[0] == 0 and read[1] > 4000
    assert re.search(r"3\.20.*\[p\. \d", document)  # the answer cites a page


def test_document_chat():
    out = run_example("document_chat.py")
    assert "3.20" in out
    reused = reused_counts(out, r"([\d,]+) of [\d,]+ prompt tokens reused")
    assert len(reused) == 3 and reused[0] < reused[1] < reused[2]
