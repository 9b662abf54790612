"""semanticache-rag: read a long document once, answer many questions from its compressed KV cache.

The public names below are imported on first use (PEP 562), so ``import semanticache_rag`` and the
command line's ``--help`` do not pay for torch and transformers until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from semanticache_rag.errors import ConfigError, ContextLengthError, DocumentError, ModelLoadError, SemantiCacheError

if TYPE_CHECKING:
    from semanticache_rag.cache import DocumentCache, Selection
    from semanticache_rag.compressors import (
        COMPRESSORS,
        Compressor,
        HalfCompressor,
        KaizenCompressor,
        KaraCompressor,
        NoCompression,
        SeKVCompressor,
        SemantiCacheCompressor,
        StreamingLLMCompressor,
        make_compressor,
    )
    from semanticache_rag.conversation import Answer, Conversation
    from semanticache_rag.documents import Document, Page, load_document
    from semanticache_rag.engine import Engine
    from semanticache_rag.generation import GenerationOptions
    from semanticache_rag.sections import SectionedCache
    from semanticache_rag.store import DocumentStore

__version__ = "0.1.0"

# public name -> the module that defines it
_LAZY = {
    "DocumentCache": "cache",
    "Selection": "cache",
    **dict.fromkeys(
        (
            "COMPRESSORS",
            "Compressor",
            "HalfCompressor",
            "KaizenCompressor",
            "KaraCompressor",
            "NoCompression",
            "SeKVCompressor",
            "SemantiCacheCompressor",
            "StreamingLLMCompressor",
            "make_compressor",
        ),
        "compressors",
    ),
    "Answer": "conversation",
    "Conversation": "conversation",
    "Document": "documents",
    "Page": "documents",
    "load_document": "documents",
    "Engine": "engine",
    "GenerationOptions": "generation",
    "SectionedCache": "sections",
    "DocumentStore": "store",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'semanticache_rag' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"semanticache_rag.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "COMPRESSORS",
    "Answer",
    "Compressor",
    "ConfigError",
    "ContextLengthError",
    "Conversation",
    "Document",
    "DocumentCache",
    "DocumentError",
    "DocumentStore",
    "Engine",
    "GenerationOptions",
    "HalfCompressor",
    "KaraCompressor",
    "KaizenCompressor",
    "ModelLoadError",
    "NoCompression",
    "Page",
    "SeKVCompressor",
    "SectionedCache",
    "Selection",
    "SemantiCacheCompressor",
    "SemantiCacheError",
    "StreamingLLMCompressor",
    "__version__",
    "load_document",
    "make_compressor",
]
