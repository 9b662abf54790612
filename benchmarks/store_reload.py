"""Reopening a document: the first read vs loading its stored cache in a fresh process.

Each step runs in a new Python process, as a user coming back to a document the next day does:
load the model, then time ``engine.read(path)`` with a :class:`DocumentStore`. The first process
reads the document (prefill + compression) and stores the cache; the second finds it on disk.
Both answer the same questions greedily; the answers must be identical.

    python -m benchmarks.store_reload [--tokens 6000] [--max-new-tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def child(args) -> None:
    """One fresh process: load the model, read (or reload) the document, answer, report as JSON."""
    from semanticache_rag import DocumentStore, Engine, make_compressor
    from semanticache_rag.documents import load_document

    started = time.perf_counter()
    store = DocumentStore(args.store)
    engine = Engine.from_pretrained(compressor=make_compressor(args.compression, args.ratio), store=store)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    cache = engine.read(args.document, progress=False)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    engine.read(args.document, progress=False)  # the same process again: a memory hit
    memory_s = time.perf_counter() - started
    started = time.perf_counter()
    load_document(args.document)  # what a reload skips: text extraction (the key needs the text)
    document_s = time.perf_counter() - started
    questions = json.loads(args.questions)
    answers = [engine.ask(cache, q, max_new_tokens=args.max_new_tokens).answer for q in questions]
    entry = store.entries()[-1]
    print(
        json.dumps(
            {
                "engine_load_s": round(load_s, 2),
                "read_s": round(read_s, 3),
                "memory_hit_s": round(memory_s, 4),
                "text_extraction_s": round(document_s, 3),
                "loaded_from_disk": store.stats.disk_hits == 1,
                "tokens": cache.length,
                "pages": cache.document.total_pages,
                "cache_bytes": cache.nbytes,
                "entries_removed": round(cache.entries_removed, 3),
                "bytes_removed": round(cache.bytes_removed, 3),
                "disk_bytes": entry.disk_bytes,
                "answers": answers,
            }
        )
    )


def run_child(store: Path, document: Path, compression: str, ratio, questions, args) -> dict:
    command = [sys.executable, "-m", "benchmarks.store_reload", "--child", "--store", str(store)]
    command += ["--document", str(document), "--compression", compression, "--questions", json.dumps(questions)]
    command += ["--max-new-tokens", str(args.max_new_tokens)] + (["--ratio", str(ratio)] if ratio is not None else [])
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent)
    return json.loads(out.stdout.splitlines()[-1])


def measure(name: str, document: Path, compression: str, ratio, questions, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="store-reload-") as store:
        first = run_child(Path(store), document, compression, ratio, questions, args)
        again = run_child(Path(store), document, compression, ratio, questions, args)
    assert not first["loaded_from_disk"] and again["loaded_from_disk"], (first, again)
    row = {
        "document": name,
        "compression": compression if ratio is None else f"{compression} {ratio}",
        "tokens": first["tokens"],
        "pages": first["pages"],
        "first_read_s": first["read_s"],
        "reload_s": again["read_s"],
        "speedup": round(first["read_s"] / again["read_s"], 1),
        "memory_hit_s": again["memory_hit_s"],
        "text_extraction_s": again["text_extraction_s"],
        "identical_answers": first["answers"] == again["answers"],
        "cache_bytes": first["cache_bytes"],
        "disk_bytes": first["disk_bytes"],
        "engine_load_s": [first["engine_load_s"], again["engine_load_s"]],
        "answers": first["answers"],
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for option in ("--store", "--document", "--compression", "--questions"):
        parser.add_argument(option, help=argparse.SUPPRESS)
    parser.add_argument("--ratio", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    from transformers import AutoTokenizer

    from benchmarks.followup_latency import QUESTIONS, real_document
    from semanticache_rag.cli import DEMO_PDF, DEMO_QUESTIONS
    from semanticache_rag.models import resolve_model

    load_before = os.getloadavg()[0]  # other work on the machine slows the first reads most
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    with tempfile.TemporaryDirectory(prefix="store-reload-doc-") as folder:
        text = Path(folder) / "gpl3.txt"
        text.write_text(real_document(tokenizer, args.tokens))
        with resources.as_file(resources.files("semanticache_rag") / "data" / DEMO_PDF) as pdf:
            rows = [
                measure("GPL-3 text", text, "none", None, list(QUESTIONS), args),
                measure("GPL-3 text", text, "semanticache", 0.75, list(QUESTIONS), args),
                measure(DEMO_PDF, pdf, "none", None, list(DEMO_QUESTIONS), args),
            ]
    result = {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "max_new_tokens": args.max_new_tokens,
        "load_average_1m_start_end": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "store_reload.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
