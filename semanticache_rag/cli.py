"""Command line: ``semanticache-rag ask | chat | demo | cache``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from importlib import resources
from pathlib import Path

from semanticache_rag.cli_cache import add_cache_commands, add_store_option, store_of
from semanticache_rag.errors import SemantiCacheError

logger = logging.getLogger("semanticache_rag")

DEMO_PDF = "cyrguide.pdf"  # "Cyrillic languages support in LaTeX", LPPL 1.3c; see data/SOURCES.md
# The demo reads compressed with what keeps its three answers right at the least memory (measured
# on the bundled PDF: Kaizen 0.75 and Kaizen + SemantiCache 0.75 keep all three, SemantiCache 0.5
# loses one, Kaizen 0.9 all three, Kaizen + SemantiCache 0.9 one).
DEMO_COMPRESSION = ("kaizen", 0.75)
# int4 weight-only matrices (the GGUF's own codes): the same three answers as fp32, 1.7x the tokens/s
DEMO_WEIGHTS = "int4"
DEMO_QUESTIONS = (
    "What is the default font encoding for Russian?",
    "Which RFC specifies koi8-r?",
    "What is the latest version of the LH fonts?",
)


def _compressor(args):
    """The compressor the options name: as given, else ``auto`` (the best measured one) for a ratio alone, else none."""
    from semanticache_rag.compressors import make_compressor

    if args.compression is None:
        args.compression = "auto" if args.ratio is not None else "none"
    return make_compressor(args.compression, args.ratio)


def _engine(args, compressor=None):
    from semanticache_rag.engine import Engine

    compressor = _compressor(args) if compressor is None else compressor
    started = time.perf_counter()
    store = None if args.no_store else store_of(args)
    layout = {"section_tokens": args.section_tokens, "max_sections": args.max_sections or None, "routing": args.routing}
    engine = Engine.from_pretrained(args.model, compressor=compressor, store=store, weights=args.weights, **layout)
    if not args.json:
        done = getattr(engine.model, "semanticache_weights", "model")
        how = "" if done == "model" else f" ({done} weights)"
        print(f"Loaded {engine.model_name}{how} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return engine


def _document_and_engine(args):
    """The FILE argument and the engine: bad options, then a bad file, are reported before the model loads.
    FILE is always a path: a name without a document suffix (``notes``, ``README``) is a file too, never the text."""
    from semanticache_rag.documents import load_document
    from semanticache_rag.weights import check_weights

    compressor = _compressor(args)
    check_weights(args.weights)
    document = load_document(Path(args.file))
    return document, _engine(args, compressor)


def _read(engine, path, args):
    stored = engine.store.stats.disk_hits if engine.store else 0
    started = time.perf_counter()
    cache = engine.read(path, progress=not args.json)
    if not args.json:
        loaded = engine.store is not None and engine.store.stats.disk_hits > stored
        how = "Loaded the stored cache of" if loaded else "Read"
        seconds = time.perf_counter() - started if loaded else cache.prefill_s + cache.compress_s
        sections = getattr(cache, "sections", None)
        parts = f" in {len(sections)} sections" if sections else ""
        print(
            f"{how} {cache.document.name}: {cache.document.total_pages} pages, {cache.length:,} tokens{parts} in "
            f"{seconds:.1f}s; cache {cache.nbytes / 2**20:.1f} MiB, uncompressed {cache.full_nbytes / 2**20:.1f} MiB "
            f"({cache.entries_removed:.0%} of entries and {cache.bytes_removed:.0%} of bytes removed)",
            file=sys.stderr,
        )
    ratios = " ".join(f"{r:.2f}" for r in cache.layer_entries_removed)
    logger.info("entries removed per layer: %s", ratios)
    return cache


def _gen_options(args) -> dict:
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stop": tuple(args.stop or ()),
        "seed": args.seed,
        "repetition_penalty": args.repetition_penalty,
        "no_repeat_ngram_size": args.no_repeat_ngram_size,
        "loop_guard": not args.no_loop_guard,
    }


def _print_answer(answer, args) -> None:
    if args.json:
        print(json.dumps(answer.to_dict(), ensure_ascii=False), flush=True)
        return
    print(f"\nQ: {answer.question}\nA: {answer.answer}")
    print(
        f"   [{answer.prefill_s + answer.decode_s:.2f}s; {answer.cached_tokens:,} of {answer.prompt_tokens:,} "
        f"prompt tokens reused from the document cache; {answer.tokens_per_s:.1f} tokens/s]"
    )
    if answer.sections_total > 1:
        print(f"   [{_sources(answer)}]")


def _sources(answer) -> str:
    """Where a long document's answer came from: its pages, and whether the question matched them."""
    pages = _page_ranges(answer.pages)
    how = "" if answer.routing_matched else "; no section matched the question, so these are the nearest"
    return f"from {len(answer.sections)} of {answer.sections_total} sections, pages {pages}{how}"


def _page_ranges(labels) -> str:
    """``1, 2, 3, 7, ix`` -> ``1-3, 7, ix`` (numeric runs joined)."""
    out: list[list[str]] = []
    for label in labels:
        if out and label.isdigit() and out[-1][-1].isdigit() and int(label) == int(out[-1][-1]) + 1:
            out[-1].append(label)
        else:
            out.append([label])
    return ", ".join(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in out)


def cmd_ask(args) -> None:
    document, engine = _document_and_engine(args)
    cache = _read(engine, document, args)
    for question in args.question:
        _print_answer(engine.ask(cache, question, **_gen_options(args)), args)


def cmd_demo(args) -> None:
    args.json = getattr(args, "json", False)
    if args.compression == DEMO_COMPRESSION[0] and args.ratio is None:
        args.ratio = DEMO_COMPRESSION[1]
    path = resources.files("semanticache_rag") / "data" / DEMO_PDF
    with resources.as_file(path) as pdf:
        engine = _engine(args)
        cache = _read(engine, pdf, args)
        options = _gen_options(args)
        for question in DEMO_QUESTIONS:
            _print_answer(engine.ask(cache, question, **options), args)


def cmd_chat(args) -> None:
    try:
        import readline  # noqa: F401 - gives input() line editing and history
    except ImportError:
        pass
    document, engine = _document_and_engine(args)
    conversation = engine.conversation(_read(engine, document, args), **_gen_options(args))
    print("Ask about the document; Ctrl-D (or an empty line twice) quits.", file=sys.stderr)
    while True:
        try:
            question = input("\n> ").strip()
        except EOFError:
            print(file=sys.stderr)
            return
        if not question:
            continue
        for piece in conversation.stream(question):
            print(piece, end="", flush=True)
        a = conversation.last_answer
        sources = f"; {_sources(a)}" if a.sections_total > 1 else ""
        print(
            f"\n   [{a.prefill_s + a.decode_s:.2f}s; {a.cached_tokens:,}/{a.prompt_tokens:,} tokens reused{sources}]",
            file=sys.stderr,
        )


def cmd_serve(args) -> None:
    try:
        import uvicorn

        from semanticache_rag.prompt_cache import PromptCache
        from semanticache_rag.server import Limits, create_app
    except ImportError as exc:
        raise SemantiCacheError(f"{exc}") from exc
    api_key = args.api_key or os.environ.get("SEMANTICACHE_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: serving on {args.host} with no API key: anyone who can reach it can use it", file=sys.stderr)
    args.json = False
    engine = _engine(args)
    limits = Limits(upload_bytes=args.max_upload_mb * 2**20, new_tokens=args.max_new_tokens, concurrent=args.concurrent)
    prompts = PromptCache(engine, compress_messages_over=args.compress_messages_over)
    app = create_app(engine, api_key=api_key, limits=limits, prompt_cache=prompts)
    print(f"Serving {engine.model_name} on http://{args.host}:{args.port} (OpenAI API under /v1)", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")


def _add_serve_command(sub) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible server and a web page for document chat")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, local only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' ($SEMANTICACHE_API_KEY)")
    serve.add_argument("--max-upload-mb", type=int, default=64, help="largest document upload (default: 64 MiB)")
    serve.add_argument("--concurrent", type=int, default=2, help="answers computed at once; others queue (default: 2)")
    serve.add_argument(
        "--compress-messages-over",
        type=int,
        default=1024,
        metavar="TOKENS",
        help="with --compression, compress a system (or first user) message of TOKENS tokens or more as a document "
        "(0: never; default: 1024)",
    )
    _add_common(serve)
    serve.set_defaults(func=cmd_serve, max_new_tokens=1024)


def cmd_vllm_serve(args) -> None:
    import shlex

    from semanticache_rag.served import find_vllm, vllm_command
    from semanticache_rag.store_entries import default_directory

    store = args.store or default_directory()
    command, env = vllm_command(args.model, store, find_vllm(args.vllm_python), args.passthrough)
    if args.dry_run:
        print(shlex.join(command))
        return
    print(f"Serving {args.model} with vLLM, document caches from {store}", file=sys.stderr)
    os.execve(command[0], command, env)


def _add_vllm_command(sub) -> None:
    p = sub.add_parser(
        "vllm-serve",
        help="vLLM's OpenAI server answering from stored document caches (its KV-transfer connector)",
        description="Run 'vllm serve MODEL' with the SemantiCache connector: requests that name a stored cache "
        "(extra_body=semanticache_rag.served.request_fields(ID)) skip the document's prefill. Arguments after "
        "'--' go to vLLM's server (e.g. -- --port 8001 --dtype float32).",
    )
    p.add_argument("model", help="the model vLLM serves (the one the caches were read with)")
    p.add_argument("--vllm-python", default=None, metavar="PATH", help="the Python of vLLM's environment (default: "
                   "this one if it has vLLM, else the venv python benchmarks/vllm_env.py builds)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    add_store_option(p)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_vllm_serve)


def _add_common(
    p: argparse.ArgumentParser,
    compression: str | None = None,
    ratio_default: str = "the compressor's own",
    weights: str = "auto",
) -> None:
    p.add_argument("--model", default=None, help="transformers model id or directory (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--weights",
        default=weights,
        help="auto (int4-exact for a Llama model whose weights are Q4_1 values, as the default model's; fp32 for "
        "another fp32 Llama model; else as loaded), model (as loaded), fp32 (an fp32 Llama model's own weights, "
        "each decoding step one C++ call: its answers, ~1.8x faster than as loaded), or fp16, bf16, int8 or int4 "
        "weight-only ones: 2-4x faster decoding on CPUs, slightly different answers (fp16: the fastest on CPUs "
        "without AVX-512, answers closest to fp32; int4 keeps the default model's GGUF codes and llama.cpp's "
        "arithmetic; int4-exact: the same codes in fp32 arithmetic, "
        f"the fp32 model's answers) (default: {weights})",
    )
    p.add_argument(
        "--compression",
        default=compression,
        help="none, fp16 (every entry, half the bytes), auto (the best measured for --ratio), semanticache, kaizen, "
        "kaizen+semanticache, sekv, "
        f"streaming_llm or kara (default: {compression or 'auto with --ratio, else none'})",
    )
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help=f"fraction of KV entries (Kaizen: bytes) to remove (default: {ratio_default})",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="> 1 makes the answer's own tokens less likely (default: 1, off)",
    )
    p.add_argument(
        "--no-repeat-ngram-size",
        type=int,
        default=0,
        help="no n-gram of this size twice in an answer (default: 0, off)",
    )
    p.add_argument(
        "--no-loop-guard",
        action="store_true",
        help="let answers that repeat a sentence or a run of tokens go on (by default they end there)",
    )
    p.add_argument(
        "--section-tokens",
        type=int,
        default=1024,
        help="documents longer than the context are read in sections of at most this many tokens (default: 1024)",
    )
    p.add_argument(
        "--max-sections",
        type=int,
        default=2,
        help="most sections of a long document per question; 0: as many as fit the context (default: 2)",
    )
    p.add_argument(
        "--routing",
        choices=("bm25", "attention", "hybrid"),
        default="bm25",
        help="how a long document's sections are chosen per question (default: bm25)",
    )
    p.add_argument("--no-store", action="store_true", help="read the document afresh; keep no cache on disk")
    add_store_option(p)
    p.add_argument("-v", "--verbose", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="semanticache-rag", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ask = sub.add_parser("ask", help="answer questions about a PDF or text file")
    ask.add_argument("file")
    ask.add_argument("-q", "--question", action="append", required=True)
    ask.add_argument("--json", action="store_true", help="one JSON object per answer")
    ask.set_defaults(func=cmd_ask)
    chat = sub.add_parser("chat", help="multi-turn chat about a document")
    chat.add_argument("file")
    chat.set_defaults(func=cmd_chat, json=False)
    demo = sub.add_parser("demo", help="read the bundled PDF and answer three questions")
    demo.set_defaults(func=cmd_demo, json=False)
    for p in (ask, chat):
        _add_common(p)
    _add_common(
        demo,
        DEMO_COMPRESSION[0],
        f"{DEMO_COMPRESSION[1]} with {DEMO_COMPRESSION[0]}, else the compressor's own",
        weights=DEMO_WEIGHTS,
    )
    _add_serve_command(sub)
    _add_vllm_command(sub)
    add_cache_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv and argv[:1] == ["vllm-serve"]:  # the rest is vLLM's
        argv, passthrough = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = build_parser().parse_args(argv)
    args.passthrough = passthrough
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        args.func(args)
    except SemantiCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
