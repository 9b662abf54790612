"""LangChain: a stuff-documents chain over the bundled PDF, answered from the document's cache.

The chain pastes all pages into every prompt, as ``create_stuff_documents_chain`` does (page
texts joined with a blank line). Registering the pages once lets the model read them once: the
first question prefills and caches the prompt up to the end of the document, later questions
compute only their own tokens.

Run (offline, default model): ``python examples/langchain_pdf_chain.py``
"""

from __future__ import annotations

from importlib import resources

from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from semanticache_rag.integrations.langchain import ChatSemantiCache, SemantiCachePDFLoader

QUESTIONS = [
    "Which RFC specifies koi8-r?",
    "What is the latest version of the LH fonts?",
    "Which package provides Russian hyphenation patterns?",
]


def main() -> None:
    with resources.as_file(resources.files("semanticache_rag") / "data" / "cyrguide.pdf") as pdf:
        pages = SemantiCachePDFLoader(pdf).load()
    # the model loads on first use, with the default weights ("auto": int4-exact for the default model)
    llm = ChatSemantiCache(max_new_tokens=48)
    llm.register_document(pages)

    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer the question using only this context.\n\n{context}"), ("human", "{question}")]
    )
    stuff = {"context": lambda _: "\n\n".join(page.page_content for page in pages), "question": RunnablePassthrough()}
    chain = stuff | prompt | llm

    for question in QUESTIONS:
        message = chain.invoke(question)
        usage = message.usage_metadata
        details = usage["input_token_details"]
        print(f"Q: {question}\nA: {message.content}")
        print(
            f"   prompt {usage['input_tokens']:,} tokens: {details['cache_read']:,} read from cache, "
            f"{details['cache_creation']:,} cached now, "
            f"{usage['input_tokens'] - details['cache_read'] - details['cache_creation']:,} computed\n"
        )


if __name__ == "__main__":
    main()
