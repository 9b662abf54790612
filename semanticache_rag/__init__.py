"""semanticache-rag: read a long document once, answer many questions from its compressed KV cache."""

from semanticache_rag.cache import DocumentCache, Selection
from semanticache_rag.compressors import (
    COMPRESSORS,
    Compressor,
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
from semanticache_rag.errors import ConfigError, ContextLengthError, DocumentError, ModelLoadError, SemantiCacheError
from semanticache_rag.generation import GenerationOptions
from semanticache_rag.sections import SectionedCache
from semanticache_rag.store import DocumentStore

__version__ = "0.1.0"

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
