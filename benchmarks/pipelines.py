"""Five questions over one real PDF through stock and cached LangChain / LlamaIndex pipelines.

(a) ``hf-pipeline``: a LangChain stuff chain (all pages pasted into the system message) with
    ``ChatHuggingFace(HuggingFacePipeline(...))``: plain transformers generation over the whole
    prompt, so every question re-reads the document;
(b) ``langchain``: the same chain with :class:`ChatSemantiCache` and the pages registered, full
    cache; ``langchain-sc75``: the same with SemantiCache at ratio 0.75; ``langchain-auto75``: with
    ``compression="auto"`` at 0.75 (Kaizen storing SemantiCache's cores);
(c) ``llama-index``: ``SummaryIndex(...).as_query_engine(response_mode="compact")`` with
    :class:`SemantiCacheLlamaLLM` and the pages registered.

Same model, same weights, greedy decoding, same answer length. Each pipeline runs in a process
of its own so that its peak memory (max RSS, model included) is its own.

    python -m benchmarks.pipelines [--pdf FILE] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# (question, a string the right answer contains) about the bundled cyrguide.pdf
QUESTIONS = (
    ("Which RFC specifies koi8-r?", "1489"),
    ("What is the latest version of the LH fonts?", "3.20"),
    ("Which package provides Russian hyphenation patterns?", "ruhyphen"),
    ("Which version of babel supports the T2* encodings?", "3.6k"),
    ("Who produced the LH fonts?", "Lapko"),
)
LANGCHAIN = {"langchain": ("none", None), "langchain-sc75": ("semanticache", 0.75), "langchain-auto75": ("auto", 0.75)}
PIPELINES = ("hf-pipeline", *LANGCHAIN, "llama-index")
SYSTEM = "Answer the question using only this context.\n\n{context}"


def _stuff_chain(llm, pages):
    """LangChain's stuff pattern: every page pasted into the prompt of every question."""
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough

    prompt = ChatPromptTemplate.from_messages([("system", SYSTEM), ("human", "{question}")])
    context = "\n\n".join(page.page_content for page in pages)
    return {"context": lambda _: context, "question": RunnablePassthrough()} | prompt | llm


def _hf_pipeline_chain(pages, max_new_tokens: int):
    from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
    from transformers import pipeline

    from semanticache_rag.models import load_model

    model, tokenizer, name = load_model(None, weights="model")  # what the stock pipelines load
    generate = pipeline(
        "text-generation",
        model=model,
        tokenizer=tokenizer,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        return_full_text=False,
    )
    llm = ChatHuggingFace(llm=HuggingFacePipeline(pipeline=generate, model_id=name), tokenizer=tokenizer)
    return _stuff_chain(llm, pages), lambda message: {}


def _langchain_chain(pages, max_new_tokens: int, compression: str, ratio: float | None):
    from semanticache_rag.integrations.langchain import ChatSemantiCache

    # the stock pipelines' weights (fp32 as loaded), so that only reading once differs
    llm = ChatSemantiCache(
        max_new_tokens=max_new_tokens, compression=compression, compression_ratio=ratio, weights="model"
    )
    llm.register_document(pages)

    def usage(message) -> dict:
        details = message.usage_metadata["input_token_details"]
        return {"input_tokens": message.usage_metadata["input_tokens"], **details}

    return _stuff_chain(llm, pages), usage


def _llama_index_engine(pdf: Path, max_new_tokens: int):
    from llama_index.core import SummaryIndex

    from semanticache_rag.integrations.llama_index import SemantiCacheLlamaLLM, SemantiCachePDFReader

    pages = SemantiCachePDFReader().load_data(pdf)
    llm = SemantiCacheLlamaLLM(max_new_tokens=max_new_tokens, weights="model")  # the stock pipelines' weights
    llm.register_document(pages)
    engine = SummaryIndex.from_documents(pages).as_query_engine(response_mode="compact", llm=llm)

    class Chain:  # the query engine under the chain's name, so one loop times both
        def invoke(self, question):
            return engine.query(question)

    return Chain(), lambda response: {}


def run_pipeline(name: str, pdf: Path, max_new_tokens: int) -> dict:
    """Answer every question through pipeline ``name``; per-question latency, answers, peak RSS."""
    from semanticache_rag.integrations.langchain import SemantiCachePDFLoader

    started = time.perf_counter()
    if name == "llama-index":
        chain, usage = _llama_index_engine(pdf, max_new_tokens)
    else:
        pages = SemantiCachePDFLoader(pdf).load()
        if name == "hf-pipeline":
            chain, usage = _hf_pipeline_chain(pages, max_new_tokens)
        else:
            chain, usage = _langchain_chain(pages, max_new_tokens, *LANGCHAIN[name])
    setup_s = time.perf_counter() - started
    rows = []
    for question, expected in QUESTIONS:
        asked = time.perf_counter()
        result = chain.invoke(question)
        text = str(getattr(result, "content", result)).strip()
        seconds = time.perf_counter() - asked
        rows.append({"question": question, "answer": text, "correct": expected.lower() in text.lower()})
        rows[-1].update(seconds=round(seconds, 2), **usage(result))
        print(f"[{name}] {seconds:6.1f}s  {question} -> {text[:80]!r}", file=sys.stderr, flush=True)
    return {
        "pipeline": name,
        "setup_s": round(setup_s, 2),
        "total_s": round(time.perf_counter() - started, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "questions": rows,
    }


def _markdown(results: list[dict]) -> str:
    lines = [
        "| pipeline | total s (5 questions, model load included) | 1st question s | later questions s (mean) "
        "| correct | peak RSS MiB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        times = [q["seconds"] for q in r["questions"]]
        later = sum(times[1:]) / len(times[1:])
        correct = sum(q["correct"] for q in r["questions"])
        lines.append(
            f"| {r['pipeline']} | {r['total_s']:.1f} | {times[0]:.1f} | {later:.2f} | {correct}/{len(times)} "
            f"| {r['peak_rss_mib']:,} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pdf", type=Path, help="PDF to ask about (default: the bundled cyrguide.pdf)")
    parser.add_argument("--only", nargs="+", choices=PIPELINES, default=list(PIPELINES))
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one pipeline, print its JSON
    args = parser.parse_args(argv)
    pdf = args.pdf or Path(str(resources.files("semanticache_rag") / "data" / "cyrguide.pdf"))
    if args.child:
        print(json.dumps(run_pipeline(args.child, pdf, args.max_new_tokens)))
        return
    results = []
    for name in args.only:
        command = [sys.executable, "-m", "benchmarks.pipelines", "--child", name, "--pdf", str(pdf)]
        out = subprocess.run(
            command + ["--max-new-tokens", str(args.max_new_tokens)],
            capture_output=False,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    RESULTS.mkdir(exist_ok=True)
    env = {"python": platform.python_version(), "machine": platform.machine(), "pdf": pdf.name}
    (RESULTS / "pipelines.json").write_text(json.dumps({"environment": env, "results": results}, indent=1) + "\n")
    table = _markdown(results)
    (RESULTS / "pipelines.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
