"""Multi-turn chat over the bundled PDF with the Python API, from a compressed cache.

The document is read once and its KV cache compressed to a quarter of its bytes with ``"auto"``
(the best measured compressor for the ratio: Kaizen's int8/int4 layers over SemantiCache's cores);
every turn then computes only its own tokens and reuses the earlier turns' tokens too.

Run (offline, default model): ``python examples/document_chat.py``
"""

from __future__ import annotations

from importlib import resources

from semanticache_rag import Engine, make_compressor

TURNS = [
    "What is the latest version of the LH fonts?",
    "Which RFC specifies koi8-r?",
    "Repeat the version number from your first answer.",
]


def main() -> None:
    # the default weights ("auto"): the default model's GGUF codes in fp32 arithmetic, its fp32 answers, faster
    engine = Engine.from_pretrained(compressor=make_compressor("auto", compression_ratio=0.75))
    with resources.as_file(resources.files("semanticache_rag") / "data" / "cyrguide.pdf") as pdf:
        cache = engine.read(pdf)
    print(
        f"Read {cache.document.name}: {cache.length:,} tokens in {cache.prefill_s:.1f} s; "
        f"cache {cache.nbytes / 2**20:.1f} MiB ({cache.entries_removed:.0%} of entries, "
        f"{cache.bytes_removed:.0%} of bytes removed)\n"
    )
    chat = engine.conversation(cache, max_new_tokens=48)
    for question in TURNS:
        answer = chat.ask(question)
        print(f"Q: {question}\nA: {answer.answer}")
        print(
            f"   {answer.cached_tokens:,} of {answer.prompt_tokens:,} prompt tokens reused, "
            f"{answer.prompt_tokens - answer.cached_tokens} computed; first token after {answer.prefill_s:.2f} s\n"
        )


if __name__ == "__main__":
    main()
