"""LlamaIndex adapters: the LLM in a stock SummaryIndex pipeline, the PDF reader, and the document engines.

Fast tests run on the tiny random Llama; the demo-PDF tests use the real default model (``slow``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from importlib import resources

import pytest

pytest.importorskip("llama_index.core")

from conftest import corpus_text  # noqa: E402
from llama_index.core import SummaryIndex  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import Document as LIDocument  # noqa: E402
from tests_support import needs_default_model  # noqa: E402

from semanticache_rag import ConfigError  # noqa: E402
from semanticache_rag.documents import read_pdf  # noqa: E402
from semanticache_rag.integrations._common import rank_pages  # noqa: E402
from semanticache_rag.integrations.llama_index import (  # noqa: E402
    DocumentQueryEngine,
    SemantiCacheLlamaLLM,
    SemantiCachePDFReader,
    to_role_dicts,
)

DEMO_PDF = resources.files("semanticache_rag") / "data" / "cyrguide.pdf"


@pytest.fixture()
def engine(tiny_llama_engine):
    return tiny_llama_engine


@pytest.fixture()
def llm(engine):
    return SemantiCacheLlamaLLM.from_engine(engine, max_new_tokens=8)


def pages() -> list[LIDocument]:
    text = corpus_text()
    return [LIDocument(text=text[i : i + 700].strip(), metadata={"page_label": str(i // 700 + 1)}) for i in (0, 700)]


def test_construction_is_lazy_and_validated():
    llm = SemantiCacheLlamaLLM(model="never-loaded", max_new_tokens=4)
    assert llm._runtime is None
    with pytest.raises(ValueError, match="max_tokens"):
        SemantiCacheLlamaLLM(max_tokens=4)


def test_metadata_describes_the_loaded_model(llm):
    meta = llm.metadata
    assert (meta.context_window, meta.num_output, meta.is_chat_model, meta.model_name) == (2048, 8, True, "tiny")


def test_complete_and_stream_complete_agree(llm):
    response = llm.complete("Who may copy it?")
    streamed = list(llm.stream_complete("Who may copy it?"))
    assert streamed[-1].text.strip() == response.text and streamed[-1].delta == ""
    assert "".join(r.delta for r in streamed).strip() == response.text
    usage = streamed[-1].raw["usage"]
    assert (
        usage["completion_tokens"] >= 1
        and usage["total_tokens"] == usage["prompt_tokens"] + 8 * 0 + usage["completion_tokens"]
    )


def test_chat_keeps_the_roles(llm):
    messages = [ChatMessage(role=MessageRole.SYSTEM, content="Be brief."), ChatMessage(content="Who may copy it?")]
    direct = llm.prompt_cache.ask(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who may copy it?"}], max_new_tokens=8
    )
    assert llm.chat(messages).message.content == direct.answer
    streamed = list(llm.stream_chat(messages))
    assert "".join(r.delta for r in streamed).strip() == direct.answer


def test_unsupported_messages_raise():
    with pytest.raises(ValueError, match="tool"):
        to_role_dicts([ChatMessage(role=MessageRole.TOOL, content="3")])
    with pytest.raises(ValueError, match="image"):
        to_role_dicts([ChatMessage(role=MessageRole.USER, blocks=[ImageBlock(url="https://example.com/x.png")])])


def test_async_variants_leave_the_event_loop_free(llm):
    messages = [ChatMessage(content="Who may copy it?")]

    async def run():
        ticks, done = 0, False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        completed = await llm.acomplete("Who may copy it?")
        chatted = await llm.achat(messages)
        streamed = "".join([r.delta async for r in await llm.astream_chat(messages)])
        streamed_completion = "".join([r.delta async for r in await llm.astream_complete("Who may copy it?")])
        done = True
        await task
        return ticks, completed.text, chatted.message.content, streamed, streamed_completion

    ticks, completed, chatted, streamed, streamed_completion = asyncio.run(run())
    assert ticks > 10
    assert chatted == completed == streamed.strip() == streamed_completion.strip()


def test_reader_pages_and_metadata():
    with resources.as_file(DEMO_PDF) as path:
        docs = SemantiCachePDFReader().load_data(path, extra_info={"topic": "cyrillic"})
        document = read_pdf(path)
    assert len(docs) == 7 and [d.metadata["page_label"] for d in docs] == [p.label for p in document.pages]
    assert docs[0].metadata == {
        "file_path": str(path),
        "file_name": "cyrguide.pdf",
        "page_label": "1",
        "topic": "cyrillic",
    }
    assert "\n\n".join(d.text for d in docs) == document.text


def test_registering_reader_pages_equals_registering_the_pdf(llm):
    with resources.as_file(DEMO_PDF) as path:
        assert llm.register_document(SemantiCachePDFReader().load_data(path)) == llm.register_document(path)


@pytest.fixture()
def llm_usage():
    """``usage`` of every LLM chat response, recorded through LlamaIndex's instrumentation events."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent

    usages = []

    class Recorder(BaseEventHandler):
        def handle(self, event, **kwargs) -> None:
            if isinstance(event, LLMChatEndEvent) and event.response is not None:
                usages.append(event.response.raw["usage"])

    dispatcher, recorder = get_dispatcher(), Recorder()
    dispatcher.add_event_handler(recorder)
    yield usages
    dispatcher.event_handlers.remove(recorder)


def summary_index_usage(llm, llm_usage, docs, **index_options) -> tuple[dict, dict]:
    """Usage of two questions through a stock SummaryIndex compact query engine, pages registered."""
    llm.register_document(docs)
    query_engine = SummaryIndex.from_documents(docs, **index_options).as_query_engine(response_mode="compact", llm=llm)
    query_engine.query("Who may copy it?")
    query_engine.query("What may be modified?")
    first, second = llm_usage  # one LLM call per query: the pages fit one prompt
    return first, second


@pytest.mark.parametrize(
    "splitter",
    [None, SentenceSplitter(chunk_size=128, chunk_overlap=32)],
    ids=["default-nodes", "small-overlapping-nodes"],
)
def test_summary_index_second_query_reads_the_cache(llm, llm_usage, splitter):
    # The anchors are the document's first and last 80 characters, so overlapping chunks and the
    # metadata lines LlamaIndex puts before each node do not hide the document.
    options = {"transformations": [splitter]} if splitter else {}
    first, second = summary_index_usage(llm, llm_usage, pages(), **options)
    assert first["cache_creation_tokens"] > 300 and first["cached_tokens"] == 0
    assert second["cached_tokens"] == first["cache_creation_tokens"] and second["cache_creation_tokens"] == 0


def short_edge_pages() -> list[LIDocument]:
    return [LIDocument(text="Title page", metadata={"page_label": "i"}), *pages(), LIDocument(text="The end.")]


def test_short_edge_pages_are_found_without_metadata_between_nodes(llm, llm_usage):
    docs = short_edge_pages()
    for doc in docs:  # node text alone: the compact prompt then holds the pages joined by "\n\n"
        doc.excluded_llm_metadata_keys = list(doc.metadata)
    first, second = summary_index_usage(llm, llm_usage, docs)
    assert second["cached_tokens"] == first["cache_creation_tokens"] > 300


def test_short_edge_pages_are_found_with_metadata_between_nodes(llm, llm_usage):
    first, second = summary_index_usage(llm, llm_usage, short_edge_pages())
    assert second["cached_tokens"] == first["cache_creation_tokens"] > 300


def test_rank_pages_rule():
    texts = ["The latest LH fonts are version 3.20.", "RFC 1489 specifies koi8-r.", "Nothing here."]
    assert rank_pages(texts, "Which version?", "3.20.", 2) == [(0, 1.0)]
    ranked = rank_pages(texts, "Which RFC specifies koi8-r?", "It is defined in an RFC.", 2)
    assert ranked[0][0] == 1 and len(ranked) == 1
    assert rank_pages(texts, "?", "", 2) == []


def test_query_engine_reads_once_and_cites_pages(llm):
    text = "\n\n".join(d.text for d in pages())
    query_engine = DocumentQueryEngine(source=text, llm=llm)
    assert query_engine._cache is None  # nothing read at construction
    first = query_engine.query("Who may copy the work?")
    second = query_engine.query("What is a covered work?")
    length = query_engine.cache.length
    for response in (first, second):
        assert response.metadata["cached_tokens"] == response.metadata["document_tokens"] == length
        assert response.metadata["prompt_tokens"] - length < 40
        assert len(response.source_nodes) <= 2
    assert all(node.node.metadata["page_label"] == "1" for node in first.source_nodes)
    assert asyncio.run(query_engine.aquery("Who may copy the work?")).response == first.response


def test_query_engine_rejects_a_cache_of_another_model(llm, engine):
    cache = engine.read("Some text. " * 30, progress=False)
    other = SemantiCacheLlamaLLM.from_engine(engine, model="x")
    object.__setattr__(cache, "model_name", "another")
    with pytest.raises(ConfigError, match="another"):
        DocumentQueryEngine.from_cache(cache, other)


def test_chat_engine_reuses_earlier_turns(llm):
    query_engine = DocumentQueryEngine(source="\n\n".join(d.text for d in pages()), llm=llm)
    chat = query_engine.as_chat_engine(max_new_tokens=6)
    first = chat.chat("Who may copy the work?")
    second = chat.stream_chat("And modify it?")
    text = "".join(second.response_gen)
    assert text.strip() == second.response and second.metadata["cached_tokens"] > first.metadata["cached_tokens"]
    assert [m.role for m in chat.chat_history] == [MessageRole.USER, MessageRole.ASSISTANT] * 2
    third = asyncio.run(chat.achat("Anything else?"))
    assert third.metadata["cached_tokens"] > second.metadata["cached_tokens"]
    chat.reset()
    assert chat.chat_history == []
    replay = chat.chat(
        "And modify it?",
        chat_history=[
            ChatMessage(content="Who may copy the work?"),
            ChatMessage(role=MessageRole.ASSISTANT, content=first.response),
        ],
    )
    assert replay.response == second.response


def test_import_without_llama_index_gives_the_install_hint():
    code = (
        "import sys; sys.modules['llama_index.core'] = None\n"
        "try:\n    import semanticache_rag.integrations.llama_index\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install "semanticache-rag[llama-index]"' in out


# -- real model over the demo PDF (a stock SummaryIndex over it: tests/test_examples.py) ---------


@pytest.fixture(scope="module")
def real_llm():
    return SemantiCacheLlamaLLM(max_new_tokens=32)


@pytest.mark.slow
@needs_default_model
def test_document_engines_over_the_demo_pdf(real_llm):
    with resources.as_file(DEMO_PDF) as path:
        query_engine = DocumentQueryEngine(source=path, llm=real_llm)
        first = query_engine.query("What is the latest version of the LH fonts?")
    assert "3.20" in first.response
    assert first.source_nodes and "3.20" in first.source_nodes[0].node.text
    second = query_engine.query("Which RFC specifies koi8-r?")
    length = query_engine.cache.length
    assert second.metadata["cached_tokens"] == second.metadata["document_tokens"] == length > 4000
    assert second.metadata["prompt_tokens"] - length < 40
    chat = query_engine.as_chat_engine()
    turn = chat.chat("What is the latest version of the LH fonts?")
    follow = chat.chat("Which RFC specifies koi8-r?")
    assert "3.20" in turn.response and follow.metadata["cached_tokens"] > length


def test_retrieved_nodes_are_spliced_from_their_caches(llm, llm_usage):
    """A retriever-based query engine (top-2 of 6 nodes, by a mock embedding): registered nodes found in
    the prompt, in any order, come from their caches; only the ones not seen before are prefilled."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    text = corpus_text()
    nodes = [
        LIDocument(text=text[i : i + 600].strip(), metadata={"page_label": str(i // 600 + 1)})
        for i in range(0, 3600, 600)
    ]
    llm.register_document(nodes)
    index = VectorStoreIndex.from_documents(nodes, embed_model=MockEmbedding(embed_dim=8))
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2, response_mode="compact")
    first = query_engine.query("Who may copy it?")
    second = query_engine.query("Who may copy it?")
    assert len(first.source_nodes) == 2
    assert llm_usage[0]["cache_creation_tokens"] > 200 and llm_usage[0]["cached_tokens"] == 0
    assert llm_usage[1]["cache_creation_tokens"] == 0
    assert llm_usage[1]["cached_tokens"] == llm_usage[0]["cache_creation_tokens"]
    assert str(second) == str(first)
