"""LangChain adapters: the standard langchain-tests suites, plus prompt caching through a stuff chain.

Unit tests run on the tiny random Llama; the integration suite and the PDF chain use the real
default model (``slow``).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from importlib import resources

import pytest

pytest.importorskip("langchain_core")

from conftest import corpus_text  # noqa: E402
from langchain_core.callbacks import UsageMetadataCallbackHandler  # noqa: E402
from langchain_core.documents import Document as LCDocument  # noqa: E402
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from tests_support import needs_default_model  # noqa: E402

from semanticache_rag import ConfigError, ModelLoadError  # noqa: E402
from semanticache_rag.documents import read_pdf  # noqa: E402
from semanticache_rag.integrations.langchain import (  # noqa: E402
    ChatSemantiCache,
    SemantiCacheLLM,
    SemantiCachePDFLoader,
    SemantiCacheRetriever,
    to_role_dicts,
)

DEMO_PDF = resources.files("semanticache_rag") / "data" / "cyrguide.pdf"
STUFF_PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer the question using only this context.\n\n{context}"), ("human", "{input}")]
)


@pytest.fixture()
def engine(tiny_llama_engine):
    return tiny_llama_engine


@pytest.fixture()
def chat(engine):
    return ChatSemantiCache.from_engine(engine, max_new_tokens=8)


def pages() -> list[LCDocument]:
    text = corpus_text()
    return [LCDocument(page_content=text[i : i + 700].strip(), metadata={"page": i // 700}) for i in (0, 700, 1400)]


def stuff_chain_factory():
    """``create_stuff_documents_chain`` from langchain-classic (in the dev extra)."""
    return pytest.importorskip("langchain_classic.chains.combine_documents").create_stuff_documents_chain


def usage_of(chain, inputs: dict) -> dict:
    handler = UsageMetadataCallbackHandler()
    chain.invoke(inputs, config={"callbacks": [handler]})
    (usage,) = handler.usage_metadata.values()
    return usage


# -- langchain-tests standard suites ----------------------------------------------------------

from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402


class TestChatSemantiCacheUnit(ChatModelUnitTests):
    """Construction never loads the model, so a name that does not exist is fine here."""

    @property
    def chat_model_class(self):
        return ChatSemantiCache

    @property
    def chat_model_params(self) -> dict:
        return {"model": "tiny-model-never-loaded"}

    @property
    def standard_chat_model_params(self) -> dict:
        # A local model has no API key, timeout or retries; unknown fields raise (extra="forbid").
        params = super().standard_chat_model_params
        return {k: v for k, v in params.items() if k not in {"api_key", "timeout", "max_retries"}}

    @property
    def supports_model_override(self) -> bool:
        return False  # one adapter serves one loaded model; a per-call model= raises ConfigError


@pytest.mark.slow
@needs_default_model
class TestChatSemantiCacheIntegration(ChatModelIntegrationTests):
    """The standard suite on SmolLM2-135M-Instruct; tools, structured output and media are not offered."""

    @property
    def chat_model_class(self):
        return ChatSemantiCache

    @property
    def chat_model_params(self) -> dict:
        return {"max_new_tokens": 24}

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        details = ["cache_read_input", "cache_creation_input"]
        return {"invoke": details, "stream": details}

    def _cached_call(self, *, stream: bool, repeat: bool) -> AIMessage:
        model = self.chat_model_class(**self.chat_model_params)
        text = f"Notice {uuid.uuid4().hex}. " + corpus_text()[:1500]
        model.register_document(text)
        messages = [SystemMessage(f"Context:\n\n{text}"), HumanMessage("What is this notice about?")]
        for _ in range(2 if repeat else 1):
            if stream:
                message = None
                for chunk in model.stream(messages):
                    message = chunk if message is None else message + chunk
            else:
                message = model.invoke(messages)
        return message

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        return self._cached_call(stream=stream, repeat=True)

    def invoke_with_cache_creation_input(self, *, stream: bool = False) -> AIMessage:
        return self._cached_call(stream=stream, repeat=False)


# -- our own unit tests (tiny model) ----------------------------------------------------------


def test_construction_is_lazy_and_validated(tmp_path):
    chat = ChatSemantiCache(model=str(tmp_path / "missing"), max_tokens=5, compression="semanticache")
    assert chat._runtime is None and chat.max_new_tokens == 5
    with pytest.raises(ModelLoadError):
        chat.invoke("hi")
    with pytest.raises(ValueError, match="timeout"):
        ChatSemantiCache(timeout=3)
    with pytest.raises(ValueError, match="not both"):
        ChatSemantiCache(max_tokens=3, max_new_tokens=4)


def test_model_directory_loads_on_first_use(tiny_model_dir):
    chat = ChatSemantiCache(model=str(tiny_model_dir), max_new_tokens=4)
    message = chat.invoke("Hello")
    assert message.response_metadata["model_name"] == str(tiny_model_dir)
    assert SemantiCacheLLM(model=str(tiny_model_dir)).engine is chat.engine  # equal settings share one engine


def test_invoke_reports_usage_and_metadata(chat):
    message = chat.invoke([SystemMessage("Be brief."), HumanMessage("Who may copy it?")])
    usage = message.usage_metadata
    assert usage["output_tokens"] >= 1 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_token_details"] == {"cache_read": 0, "cache_creation": 0}
    assert message.response_metadata["model_name"] == "tiny"
    assert message.response_metadata["finish_reason"] in {"stop", "length"}


def test_stream_matches_invoke_and_ends_with_usage(chat):
    chunks = list(chat.stream("Who may copy it?"))
    full = chunks[0]
    for chunk in chunks[1:]:
        full += chunk
    assert full.content.strip() == chat.invoke("Who may copy it?").content
    assert chunks[-1].chunk_position == "last" and chunks[-1].usage_metadata["output_tokens"] >= 1
    assert sum(1 for c in chunks if c.usage_metadata) == 1


def test_stop_sequences_cut_the_answer(chat):
    full = chat.invoke("Say something.", max_tokens=12).content
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = chat.invoke("Say something.", max_tokens=12, stop=[stop]).content
    assert full.startswith(cut) and stop not in cut
    assert ChatSemantiCache.from_engine(chat.engine, stop=[stop], max_tokens=12).invoke("Say something.").content == cut


def test_async_calls_leave_the_event_loop_free(chat):
    async def run() -> tuple[int, str, str]:
        ticks, done = 0, False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        invoked = await chat.ainvoke("Who may copy it?", max_tokens=12)
        streamed = "".join([chunk.content async for chunk in chat.astream("Who may copy it?", max_tokens=12)])
        done = True
        await task
        return ticks, invoked.content, streamed

    ticks, invoked, streamed = asyncio.run(run())
    assert ticks > 10  # a blocking call would let the ticker run only between calls
    assert streamed.strip() == invoked


def test_messages_become_role_dicts():
    human = HumanMessage([{"type": "text", "text": "h"}])
    messages = [SystemMessage("s"), human, AIMessage("a"), ChatMessage(role="user", content="c")]
    assert to_role_dicts(messages) == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "h"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "c"},
    ]
    with pytest.raises(ValueError, match="ToolMessage"):
        to_role_dicts([ToolMessage("3", tool_call_id="1")])
    with pytest.raises(ValueError, match="image"):
        to_role_dicts([HumanMessage([{"type": "image", "url": "https://example.com/x.png"}])])


def test_bad_call_options_raise(chat):
    with pytest.raises(ConfigError, match="per-call model"):
        chat.invoke("hi", model="another-model")
    with pytest.raises(ConfigError, match="unknown generation option"):
        chat.invoke("hi", frequency_penalty=1.0)


def test_token_counts_use_the_engine_tokenizer(chat, tiny_tokenizer):
    text = "The licensee may copy the work."
    assert chat.get_token_ids(text) == tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    rendered = chat.prompt_cache.render([{"role": "user", "content": text}])
    assert chat.get_num_tokens_from_messages([HumanMessage(text)]) == chat.get_num_tokens(rendered)


def test_stuff_chain_second_question_reads_the_cache(chat):
    create_stuff_documents_chain = stuff_chain_factory()

    docs = pages()
    chat.register_document(docs)
    chain = create_stuff_documents_chain(chat, STUFF_PROMPT)
    first = usage_of(chain, {"context": docs, "input": "Who may copy it?"})
    second = usage_of(chain, {"context": docs, "input": "What may be modified?"})
    created = first["input_token_details"]["cache_creation"]
    assert first["input_token_details"]["cache_read"] == 0 and created > 300
    assert second["input_token_details"] == {"cache_read": created, "cache_creation": 0}
    assert second["input_tokens"] - created < 30  # only the question and the template's tail


def test_llm_shares_registered_documents_with_the_chat_model(chat):
    llm = SemantiCacheLLM.from_engine(chat.engine, prompt_cache=chat.prompt_cache, max_new_tokens=6)
    text = "\n\n".join(page.page_content for page in pages())
    chat.register_document(pages())
    prompt = f"Context:\n\n{text}\n\nQuestion: who may copy it?"
    first = llm.generate([prompt]).generations[0][0].generation_info
    second = llm.generate([prompt]).generations[0][0].generation_info
    assert first["cache_creation"] > 300 and second["cache_read"] == first["cache_creation"]
    streamed = "".join(llm.stream(prompt))
    assert streamed.strip() == llm.invoke(prompt)
    assert asyncio.run(llm.ainvoke(prompt)) == llm.invoke(prompt)


def test_pdf_loader_pages_and_metadata():
    with resources.as_file(DEMO_PDF) as path:
        docs = SemantiCachePDFLoader(path).load()
        document = read_pdf(path)
    assert [d.metadata["page"] for d in docs] == list(range(7))
    assert {d.metadata["total_pages"] for d in docs} == {7}
    assert [d.metadata["page_label"] for d in docs] == [p.label for p in document.pages]
    assert docs[0].metadata["source"] == str(path)
    assert "\n\n".join(d.page_content for d in docs) == document.text


def test_registering_loader_pages_equals_registering_the_pdf(chat):
    with resources.as_file(DEMO_PDF) as path:
        assert chat.register_document(SemantiCachePDFLoader(path).load()) == chat.register_document(path)


def test_pages_with_compatibility_characters_are_found(chat):
    docs = [
        LCDocument(page_content="The \ufb01rst page reports the \ufb01nancial results of the year in some detail."),
        LCDocument(page_content="The second page is long enough to hold the whole eighty-character tail anchor."),
    ]
    chat.register_document(docs)
    messages = STUFF_PROMPT.format_messages(context="\n\n".join(d.page_content for d in docs), input="Who?")
    assert chat.prompt_cache.locate(chat.prompt_cache.render(to_role_dicts(messages))) is not None


def test_import_without_langchain_gives_the_install_hint():
    code = (
        "import sys; sys.modules['langchain_core'] = None\n"
        "try:\n    import semanticache_rag.integrations.langchain\n"
        "except ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 'pip install "semanticache-rag[langchain]"' in out


def test_package_import_pulls_in_no_framework():
    frameworks = "{'langchain_core', 'langchain', 'langchain_classic', 'llama_index'}"
    code = (  # every public name of the package (imported on first use), the engine and the store included
        "import sys\nfrom semanticache_rag import *\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {frameworks}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- chains (with the real model over the demo PDF: tests/test_examples.py) --------------------


def test_sekv_zoom_is_reported_through_the_stuff_chain(tiny_llama, tiny_tokenizer):
    from semanticache_rag import Engine, SeKVCompressor

    engine = Engine(tiny_llama, tiny_tokenizer, compressor=SeKVCompressor(0.5, zoom_tokens=64), prefill_chunk=64)
    chat = ChatSemantiCache.from_engine(engine, max_new_tokens=4)
    docs = pages()
    chat.register_document(docs)
    chain = stuff_chain_factory()(chat, STUFF_PROMPT)
    chain.invoke({"context": docs, "input": "Who may copy it?"})
    message = chat.invoke(STUFF_PROMPT.invoke({"context": "\n\n".join(d.page_content for d in docs), "input": "Why?"}))
    meta = message.response_metadata
    assert message.usage_metadata["input_token_details"]["cache_read"] > 300
    assert 0 < meta["tokens_reconstructed"] <= 64 and meta["spans_expanded"] > 0 and meta["host_bytes"] > 0


def test_retriever_routes_to_sections_and_a_retrieval_chain_reuses_their_caches(tiny_llama, tiny_tokenizer):
    from langchain_classic.chains import create_retrieval_chain

    from semanticache_rag import Engine

    engine = Engine(tiny_llama, tiny_tokenizer, model_name="tiny", section_tokens=256, prefill_chunk=64)
    chat = ChatSemantiCache.from_engine(engine, max_new_tokens=4)
    retriever = SemantiCacheRetriever(source=corpus_text(), llm=chat, k=2)
    docs = retriever.invoke("patent license royalties")
    assert len(docs) == 2 and docs[0].metadata["score"] >= docs[1].metadata["score"] > 0
    assert "patent" in docs[0].page_content.lower() and docs[0].metadata["pages"] == ["1"]
    assert docs[0].page_content in corpus_text() and docs[0].metadata["section"] != docs[1].metadata["section"]
    chain = create_retrieval_chain(retriever, stuff_chain_factory()(chat, STUFF_PROMPT))
    first = usage_of(chain, {"input": "What about patent royalties?"})
    second = usage_of(chain, {"input": "What about patent royalties?"})  # the same sections again
    assert first["input_token_details"]["cache_creation"] > 200
    assert second["input_token_details"] == {
        "cache_read": first["input_token_details"]["cache_creation"],
        "cache_creation": 0,
    }
    result = chain.invoke({"input": "Who holds the copyright?"})
    assert result["context"] and all("pages" in d.metadata for d in result["context"])


def test_settings_that_differ_in_compression_share_one_model(tiny_model_dir, monkeypatch):
    from semanticache_rag import models
    from semanticache_rag.integrations import _common

    monkeypatch.setattr(_common, "_RUNTIMES", _common.OrderedDict())
    monkeypatch.setattr(_common, "_MODELS", _common.OrderedDict())
    monkeypatch.setattr(_common, "_AUTO", {})
    loads, real = [], models.load_model
    monkeypatch.setattr(
        models, "load_model", lambda name, weights="auto": loads.append(name) or real(name, weights=weights)
    )
    plain = ChatSemantiCache(model=str(tiny_model_dir)).engine
    squeezed = ChatSemantiCache(model=str(tiny_model_dir), compression="semanticache", compression_ratio=0.5).engine
    assert plain.model is squeezed.model and loads == [str(tiny_model_dir)]
    assert plain.compressor.name == "none" and squeezed.compressor.name == "semanticache"
    engines = [  # many settings: the registry keeps the last few
        ChatSemantiCache(model=str(tiny_model_dir), compression="streaming_llm", compression_ratio=r / 20).engine
        for r in range(1, 12)
    ]
    assert (
        len({id(e.model) for e in engines}) == 1 and len(_common._RUNTIMES) <= _common.MAX_RUNTIMES and len(loads) == 1
    )
    # another weight format is another model
    quick = ChatSemantiCache(model=str(tiny_model_dir), weights="int8").engine
    assert quick.model is not plain.model and quick.model.semanticache_weights == "int8" and len(loads) == 2
    assert ChatSemantiCache.from_engine(quick).weights == "int8"
    # "auto" gave the tiny model a format (fp32 with the C++ kernels, else as loaded): asking for it shares the model
    done = getattr(plain.model, "semanticache_weights", "model")
    assert ChatSemantiCache(model=str(tiny_model_dir), weights=done).engine.model is plain.model and len(loads) == 2


def test_a_repeated_system_message_is_read_from_the_cache_without_registration(chat):
    system = SystemMessage("Answer from this text.\n\n" + corpus_text()[:2000])
    first = chat.invoke([system, HumanMessage("Who may copy it?")])
    second = chat.invoke([system, HumanMessage("What may be modified?")])
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    assert second.usage_metadata["input_token_details"]["cache_read"] > 500
