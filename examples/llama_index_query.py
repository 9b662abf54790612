"""LlamaIndex: query the bundled PDF with a stock SummaryIndex and with a DocumentQueryEngine.

1. ``SummaryIndex(...).as_query_engine(response_mode="compact")`` pastes every page into each
   prompt; with the pages registered, the LLM reads them once and later queries reuse the cache.
2. ``DocumentQueryEngine`` reads the document once into its compressed cache, answers each
   question from it and cites the pages the answer most likely came from.

Run (offline, default model): ``python examples/llama_index_query.py``
"""

from __future__ import annotations

from importlib import resources

from llama_index.core import SummaryIndex
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

from semanticache_rag.integrations.llama_index import DocumentQueryEngine, SemantiCacheLlamaLLM, SemantiCachePDFReader

QUESTIONS = ["Which RFC specifies koi8-r?", "What is the latest version of the LH fonts?"]


class CacheUsage(BaseEventHandler):
    """Prints how much of each LLM prompt was read from the cache."""

    def handle(self, event, **kwargs) -> None:
        if isinstance(event, LLMChatEndEvent) and event.response is not None:
            usage = event.response.raw["usage"]
            print(
                f"   prompt {usage['prompt_tokens']:,} tokens: {usage['cached_tokens']:,} read from cache, "
                f"{usage['cache_creation_tokens']:,} cached now"
            )


def main() -> None:
    with resources.as_file(resources.files("semanticache_rag") / "data" / "cyrguide.pdf") as pdf:
        pages = SemantiCachePDFReader().load_data(pdf)
        # the model loads on first use, with the default weights ("auto": int4-exact for the default model)
        llm = SemantiCacheLlamaLLM(max_new_tokens=48)
        document_engine = DocumentQueryEngine(source=pdf, llm=llm)

    print("== SummaryIndex, compact response mode ==")
    llm.register_document(pages)
    get_dispatcher().add_event_handler(CacheUsage())
    summary_engine = SummaryIndex.from_documents(pages).as_query_engine(response_mode="compact", llm=llm)
    for question in QUESTIONS:
        print(f"Q: {question}")
        print(f"A: {summary_engine.query(question)}\n")

    print("== DocumentQueryEngine ==")
    for question in QUESTIONS:
        response = document_engine.query(question)
        cited = ", ".join(f"p. {n.node.metadata['page_label']}" for n in response.source_nodes)
        meta = response.metadata
        print(f"Q: {question}\nA: {response} [{cited}]")
        print(f"   {meta['cached_tokens']:,} of {meta['prompt_tokens']:,} prompt tokens read from the document cache\n")


if __name__ == "__main__":
    main()
