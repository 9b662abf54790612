"""Errors raised by semanticache-rag.

Every error says what was wrong and what to do about it; the CLI prints the message without a
traceback. All of them derive from :class:`SemantiCacheError`, so callers can catch one class.
"""

from __future__ import annotations


class SemantiCacheError(Exception):
    """Base class of every error this package raises on purpose."""


class DocumentError(SemantiCacheError):
    """A document cannot be read: missing, unreadable, encrypted, corrupt, empty or image-only."""


class ContextLengthError(SemantiCacheError):
    """A document (plus room for a question and answer) does not fit the model's context."""


class ModelLoadError(SemantiCacheError):
    """A model or tokenizer cannot be found or loaded."""


class ConfigError(SemantiCacheError, ValueError):
    """A configuration value is outside its allowed range."""


class StoreError(SemantiCacheError):
    """A document cache store entry cannot be found, read or removed (see ``semanticache-rag cache list``)."""
