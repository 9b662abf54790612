"""Benchmarks of semanticache-rag (run as ``python -m benchmarks.<name>``)."""
