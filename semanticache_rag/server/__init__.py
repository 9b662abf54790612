"""An OpenAI-compatible server and a web page for document chat (``pip install "semanticache-rag[server]"``).

``semanticache-rag serve`` runs it; :func:`create_app` builds the ASGI app around an engine.
"""

from __future__ import annotations

try:
    import fastapi  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by the import-hint test
    raise ImportError(
        'the semanticache-rag server needs FastAPI and uvicorn: pip install "semanticache-rag[server]"'
    ) from exc

from semanticache_rag.server.app import Limits, create_app

__all__ = ["Limits", "create_app"]
