"""One real long PDF end to end: a 236-page manual read once, five questions, ours vs text RAG.

R's "Writing R Extensions" (``R-exts.pdf`` from Debian's ``r-doc-pdf``, 236 pages, ~150K tokens)
is read once as sections (uncompressed and SemantiCache 0.75 from one prefill); each question is
then answered from the two sections the router picks, spliced from their caches (ours), and from
the same two sections pasted as text and prefilled for the question (text RAG). The questions and
the words a correct answer must hold were written from the manual.

    python -m benchmarks.long_documents --pdf /usr/share/R/doc/manual/R-exts.pdf
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from benchmarks.report import environment

QUESTIONS = (
    ("Which C routine registers native routines with R?", "R_registerRoutines"),
    ("Which file of a package holds its name, version, authors and maintainer?", "DESCRIPTION"),
    ("Which DESCRIPTION field names packages whose C or C++ headers are needed at installation?", "LinkingTo"),
    ("Which tool finds memory errors in compiled code run by R?", "valgrind"),
    ("Which interface function calls compiled code with R objects as arguments?", ".Call"),
)
RATIOS = (0.0, 0.75)


def run_pdf(engine, path: Path, out: Path, started: float) -> None:
    from benchmarks.long_documents import _fit_text, read_sectioned

    engine.max_sections = 2
    read_started = time.perf_counter()
    caches, timing = read_sectioned(engine, path, RATIOS)
    read_s = time.perf_counter() - read_started
    rows = []
    for question, expected in QUESTIONS:
        for ratio in RATIOS:
            answer = engine.ask(caches[ratio], question, max_new_tokens=48)
            rows.append(
                {
                    "method": f"sections {ratio:g}",
                    "question": question,
                    "answer": answer.answer,
                    "correct": expected.lower() in answer.answer.lower(),
                    "ttft_s": answer.prefill_s,
                    "total_s": answer.prefill_s + answer.decode_s,
                    "pages": list(answer.pages),
                }
            )
        chosen = rows[-2]["pages"]
        sections = caches[0.0].select(engine, question, engine.context_length).sections
        rag = _fit_text(engine, caches[0.0], list(sections), question)
        rows.append(
            {
                "method": "text RAG",
                "question": question,
                "answer": rag["answer"],
                "correct": expected.lower() in rag["answer"].lower(),
                "ttft_s": rag["ttft_s"],
                "total_s": rag["total_s"],
                "pages": chosen,
            }
        )
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "long_pdf.jsonl", "w") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in rows)
    document = caches[0.0].document
    lines = [
        f"{path.name}: {document.total_pages} pages, {timing['tokens']:,} tokens, {timing['sections']} sections; "
        f"read once in {read_s:.0f} s (both ratios; compression {sum(timing['compress_s'].values()):.0f} s of it); "
        f"kept {caches[0.0].nbytes / 2**20:,.0f} MiB uncompressed, {caches[0.75].nbytes / 2**20:,.0f} MiB at 0.75.",
        "",
        "| method | correct (of 5) | time to first token (s) | per question (s) |",
        "|---|---|---|---|",
    ]
    for method in dict.fromkeys(r["method"] for r in rows):
        group = [r for r in rows if r["method"] == method]
        lines.append(
            f"| {method} | {sum(r['correct'] for r in group)} | {statistics.mean(r['ttft_s'] for r in group):.2f} | "
            f"{statistics.mean(r['total_s'] for r in group):.2f} |"
        )
    lines += ["", "| question | method | answer | pages |", "|---|---|---|---|"]
    for r in rows:
        answer = r["answer"].replace("\n", " ").replace("|", "\\|")[:160]
        lines.append(f"| {r['question']} | {r['method']} | {answer} | {', '.join(r['pages'])} |")
    text = "\n".join(lines)
    (out / "long_pdf.md").write_text(f"# One long PDF end to end\n\n{text}\n\n{environment(started)}\n")
    print(text)
