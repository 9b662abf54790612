"""Command line: ``semanticache-rag ask | chat | demo``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from importlib import resources

from semanticache_rag.errors import SemantiCacheError

logger = logging.getLogger("semanticache_rag")

DEMO_PDF = "cyrguide.pdf"  # "Cyrillic languages support in LaTeX", LPPL 1.3c; see data/SOURCES.md
DEMO_QUESTIONS = (
    "What is the default font encoding for Russian?",
    "Which RFC specifies koi8-r?",
    "What is the latest version of the LH fonts?",
)


def _engine(args):
    from semanticache_rag.compressors import make_compressor
    from semanticache_rag.engine import Engine

    compressor = make_compressor(args.compression, args.ratio)
    started = time.perf_counter()
    engine = Engine.from_pretrained(args.model, compressor=compressor)
    if not args.json:
        print(f"Loaded {engine.model_name} in {time.perf_counter() - started:.1f}s", file=sys.stderr)
    return engine


def _read(engine, path, args):
    cache = engine.read(path, progress=not args.json)
    if not args.json:
        print(
            f"Read {cache.document.name}: {cache.document.total_pages} pages, {cache.length:,} tokens in "
            f"{cache.prefill_s + cache.compress_s:.1f}s; cache {cache.nbytes / 2**20:.1f} MiB "
            f"({cache.compression_ratio:.0%} of entries removed)",
            file=sys.stderr,
        )
    ratios = " ".join(f"{r:.2f}" for r in cache.layer_compression_ratios)
    logger.info("compression ratio per layer: %s", ratios)
    return cache


def _gen_options(args) -> dict:
    return {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stop": tuple(args.stop or ()),
        "seed": args.seed,
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


def cmd_ask(args) -> None:
    engine = _engine(args)
    cache = _read(engine, args.file, args)
    for question in args.question:
        _print_answer(engine.ask(cache, question, **_gen_options(args)), args)


def cmd_demo(args) -> None:
    args.json = getattr(args, "json", False)
    path = resources.files("semanticache_rag") / "data" / DEMO_PDF
    with resources.as_file(path) as pdf:
        engine = _engine(args)
        cache = _read(engine, pdf, args)
        options = _gen_options(args)
        options["stop"] = options["stop"] or ("\n\n",)  # one-paragraph answers; a 135M model may loop
        for question in DEMO_QUESTIONS:
            _print_answer(engine.ask(cache, question, **options), args)


def cmd_chat(args) -> None:
    try:
        import readline  # noqa: F401 - gives input() line editing and history
    except ImportError:
        pass
    engine = _engine(args)
    conversation = engine.conversation(_read(engine, args.file, args), **_gen_options(args))
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
        print(
            f"\n   [{a.prefill_s + a.decode_s:.2f}s; {a.cached_tokens:,}/{a.prompt_tokens:,} tokens reused]",
            file=sys.stderr,
        )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="transformers model id or directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--compression", default="none", help="compressor name (default: none)")
    p.add_argument(
        "--ratio", type=float, default=None, help="fraction of KV entries to remove (default: the compressor's own)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None)
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
    for p in (ask, chat, demo):
        _add_common(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
