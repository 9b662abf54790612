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


def prompt_usage(output: str, pattern: str) -> list[tuple[int, ...]]:
    """The numbers of each line matching ``pattern`` (its groups), in order."""
    matches = (match if isinstance(match, tuple) else (match,) for match in re.findall(pattern, output))
    return [tuple(int(n.replace(",", "")) for n in match) for match in matches]


def test_langchain_pdf_chain():
    pytest.importorskip("langchain_core")
    out = run_example("langchain_pdf_chain.py")
    assert "3.20" in out
    usage = prompt_usage(out, r"prompt ([\d,]+) tokens: ([\d,]+) read from cache, ([\d,]+) cached now")
    assert len(usage) == 3
    (_, first_read, created), *later = usage
    assert first_read == 0 and created > 4000  # the first question reads the pages once
    for prompt, read, cached_now in later:  # later ones read them from the cache and compute their own tokens
        assert read == created and cached_now == 0 and prompt - read < 60


def test_llama_index_query():
    pytest.importorskip("llama_index.core")
    out = run_example("llama_index_query.py")
    summary, document = out.split("== DocumentQueryEngine ==")
    assert "3.20" in summary and "3.20" in document
    (_, first_read, created), (prompt, read, cached_now) = prompt_usage(
        summary, r"prompt ([\d,]+) tokens: ([\d,]+) read from cache, ([\d,]+) cached now"
    )
    assert first_read == 0 and created > 4000 and read == created and cached_now == 0 and prompt - read < 60
    assert re.search(r"3\.20.*\[p\. \d", document)  # the answer cites a page
    answers = prompt_usage(document, r"([\d,]+) of ([\d,]+) prompt tokens read from the document cache")
    assert len(answers) == 2 and all(cached > 4000 and prompt - cached < 40 for cached, prompt in answers)


def test_document_chat():
    out = run_example("document_chat.py")
    assert "3.20" in out
    reused = [count for (count,) in prompt_usage(out, r"([\d,]+) of [\d,]+ prompt tokens reused")]
    assert len(reused) == 3 and reused[0] < reused[1] < reused[2]
