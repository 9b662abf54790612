"""Framework adapters of semanticache-rag, installed as ``semanticache_rag.integrations``.

Imports nothing on purpose, so ``import semanticache_rag`` never pulls in a framework.
"""
