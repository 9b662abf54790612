"""A real long document with the real default model: read in sections, answered from the CLI (~1 min)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests_support import NEEDLE, QUESTION, needs_default_model

from semanticache_rag.cli import main

pytestmark = [pytest.mark.slow, needs_default_model]


def test_a_fact_deep_in_a_16k_token_document_is_answered_from_the_cli(tmp_path, capsys):
    """Twice the model's 8K context: read in sections once, the question routed to the fact's section."""
    licences = ("GPL-3", "LGPL-2.1", "Apache-2.0")  # 15.8K tokens
    text = "\n\n".join(Path("/usr/share/common-licenses", name).read_text() for name in licences)
    cut = text.rfind("\n\n", 0, int(0.7 * len(text))) + 2
    document = tmp_path / "licences.txt"
    document.write_text(text[:cut] + NEEDLE.format(value="7351946") + "\n\n" + text[cut:])
    args = ["ask", str(document), "-q", QUESTION, "--json", "--no-store", "--max-sections", "2"]
    assert main([*args, "--max-new-tokens", "24"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["document_tokens"] < 8192 and answer["sections_total"] >= 15  # 15K+ tokens, 1,024 a section
    assert "7351946" in answer["answer"] and answer["routing_matched"] and len(answer["sections"]) == 2
