"""LangChain documents from this package: a PDF loader and a retriever over a long document's sections.

Exported by :mod:`semanticache_rag.integrations.langchain`; import them from there.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from langchain_core.document_loaders import BaseLoader
from langchain_core.documents import Document as LCDocument
from langchain_core.retrievers import BaseRetriever
from pydantic import Field, PrivateAttr

from semanticache_rag.documents import load_document, read_pdf
from semanticache_rag.routing import BM25Router, ranking
from semanticache_rag.sections import character_spans, plan_sections


class SemantiCachePDFLoader(BaseLoader):
    """Load a PDF as one LangChain ``Document`` per page, with this package's text extraction.

    Metadata matches ``PyPDFLoader``'s: ``source`` (the path as given), ``page`` (0-based),
    ``page_label`` (the PDF's printed label) and ``total_pages``. Joining the pages'
    ``page_content`` with ``"\\n\\n"`` gives exactly the text :func:`~semanticache_rag.documents.read_pdf`
    reads, so a stuff chain's prompt contains the registered document verbatim.

    Parameters
    ----------
    file_path : str or os.PathLike
    """

    def __init__(self, file_path: str | os.PathLike[str]):
        self.file_path = file_path

    def lazy_load(self) -> Iterator[LCDocument]:
        """Yield the pages; raises :class:`~semanticache_rag.DocumentError` for unreadable PDFs."""
        document = read_pdf(self.file_path)
        for page in document.pages:
            metadata = {
                "source": str(self.file_path),
                "page": page.number - 1,
                "page_label": page.label,
                "total_pages": document.total_pages,
            }
            yield LCDocument(page_content=document.text[page.start : page.end], metadata=metadata)


class SemantiCacheRetriever(BaseRetriever):
    """A long document's sections that a question needs, by this package's routing (BM25 over sections).

    The document is split as :meth:`Engine.read <semanticache_rag.Engine.read>` splits it (page and
    paragraph boundaries, at most ``section_tokens`` tokens) and nothing is prefilled: routing needs
    no model run. Each returned ``Document`` is one section, with ``metadata`` ``source``,
    ``pages`` (labels), ``page`` (0-based first page), ``page_label``, ``section`` and ``score``.
    With an ``llm`` the sections are registered with its prompt cache, so a chain that pastes them
    into the prompt (e.g. ``create_retrieval_chain`` with a stuff chain) is answered from their
    caches: each section is prefilled once after the chain's prompt head, however often and in
    whatever order it is retrieved.

    Example
    -------
    >>> llm = ChatSemantiCache()
    >>> retriever = SemantiCacheRetriever(source="R-exts.pdf", llm=llm, k=2)
    >>> retriever.invoke("How do I register native routines?")[0].metadata["pages"]
    """

    source: Any = Field(description="Path of a PDF or text file, the text itself, or a semanticache Document.")
    llm: Any = Field(description="A ChatSemantiCache or SemantiCacheLLM: its tokenizer and prompt cache.")
    k: int = Field(default=4, ge=1, description="Sections returned per query, best first.")

    _index: Any = PrivateAttr(default=None)

    def _sections(self):
        """(document, character spans, router), built once."""
        if self._index is None:
            engine = self.llm.engine
            document = load_document(self.source)
            _, offsets, _ = engine.tokenize_document(document)
            spans = character_spans(document, offsets, plan_sections(document, offsets, engine.section_tokens))
            texts = [document.text[a:b] for a, b in spans]
            self.llm.prompt_cache.register(texts)
            self._index = (document, spans, BM25Router(texts))
        return self._index

    def _get_relevant_documents(self, query: str, *, run_manager: Any = None) -> list[LCDocument]:
        document, spans, router = self._sections()
        scores = router.scores(query)
        found = []
        for k in ranking(scores)[: self.k]:
            start, end = spans[k]
            pages = [p for p in document.pages if p.start < end and p.end >= start] or [document.page_at(start)]
            metadata = {
                "source": document.source or document.name,
                "pages": [p.label for p in pages],
                "page": pages[0].number - 1,
                "page_label": pages[0].label,
                "section": k,
                "score": float(scores[k]),
            }
            found.append(LCDocument(page_content=document.text[start:end], metadata=metadata))
        return found
