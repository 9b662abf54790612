"""Compute kernels of semanticache-rag, installed as ``semanticache_rag.kernels``.

Each operation has a pure-torch implementation (``<op>_ref.py``), which is the CPU product path
and the reference for any accelerated twin. This file imports nothing on purpose: a source
checkout on ``sys.path`` must not shadow the PyPI package ``kernels`` that transformers probes.
"""
