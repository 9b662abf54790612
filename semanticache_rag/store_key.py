"""The key of a stored document cache: document, model identity, compressor, format and version.

Two caches with equal keys are interchangeable: same document text and page map, same model
(weights, config, dtype, tokenizer, prompt head, prefill chunking), same compressor
configuration, read by the same package version.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from semanticache_rag.documents import Document
from semanticache_rag.store_format import FORMAT_VERSION, atomic_write, file_sha256, package_version

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


@dataclass(frozen=True)
class CacheKey:
    """Everything a document cache depends on; equal keys give interchangeable caches.

    Attributes
    ----------
    document_sha256 : str
        :attr:`Document.sha256` of the document's text.
    pages_sha256 : str
        Digest of the page map (page starts, ends and labels), which ``token_pages`` depends on.
    model_name : str
        The engine's model name (reported in answers).
    model : str
        Digest of the model identity: weights, config, dtype, tokenizer, prompt head, prefill chunk,
        section length (see :func:`model_identity`).
    compressor : str
        ``repr`` of the compressor dataclass: its name and full configuration.
    prompt : str
        Empty for :meth:`Engine.read <semanticache_rag.Engine.read>`; for a pipeline prompt that holds
        a registered document (:class:`~semanticache_rag.prompt_cache.PromptCache`), the digest of
        the prompt up to the document's end and of where the document starts in it.
    format_version, package_version
        Of the package that wrote the entry; another version never loads it.
    """

    document_sha256: str
    pages_sha256: str
    model_name: str
    model: str
    compressor: str
    prompt: str = ""
    format_version: int = FORMAT_VERSION
    package_version: str = field(default_factory=package_version)

    @property
    def id(self) -> str:
        """Hex SHA-256 of the key: the entry's file name (never a user or document string)."""
        return _digest(json.dumps(asdict(self), sort_keys=True))

    @classmethod
    def for_read(cls, engine, document: Document, memo: Path | None = None, prompt: str = "") -> CacheKey:
        """The key of ``engine.read(document)`` (``memo``: see :func:`model_identity`), or of a
        pipeline prompt's prefix holding ``document`` (``prompt``: see :attr:`prompt`)."""
        pages = [[p.number, p.label, p.start, p.end] for p in document.pages]
        identity = model_identity(engine, memo)
        return cls(
            document.sha256, _digest(json.dumps(pages)), engine.model_name, identity, repr(engine.compressor), prompt
        )


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- model identity ---------------------------------------------------------------------------

_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_identity(engine, memo: Path | None = None) -> str:
    """Digest of what makes ``engine``'s caches: computed once per engine.

    Weights are hashed from the model's files on disk when it was loaded from a local directory
    (SHA-256 of each weight file, memoised in ``memo`` by path, size and modification time, so a
    process pays it once per model file, ~0.7 s for the default model's 540 MB); otherwise from
    the in-memory state dict (names, dtypes, shapes, bytes). Weight format (:mod:`.weights`), config,
    dtype, tokenizer, prompt head, prefill chunk and section sizes are part of the identity too: each
    changes the cached keys and values.
    """
    if engine in _IDENTITIES:
        return _IDENTITIES[engine]
    model, tokenizer = engine.model, engine.tokenizer
    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_")}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = {
        "class": type(model).__name__,
        "dtype": str(model.dtype),
        "weights_format": getattr(model, "semanticache_weights", "model"),
        "config": config,
        "weights": weights_digest(model, memo),
        "tokenizer": _digest(vocab),
        "head": engine.prompt.head,
        "prefill_chunk": engine.prefill_chunk,
        "section_tokens": engine.section_tokens,
    }
    identity = _digest(json.dumps(parts, sort_keys=True, default=str))
    _IDENTITIES[engine] = identity
    return identity


def weights_digest(model, memo: Path | None = None) -> str:
    """SHA-256 of the model's weight files (see :func:`model_identity`), else of its state dict."""
    name = str(getattr(model.config, "_name_or_path", "") or "")
    folder = Path(name).expanduser()
    try:
        files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES) if name and folder.is_dir() else []
        if files:
            return _files_digest(files, memo)
    except OSError:  # an unreadable model folder: hash the weights in memory instead
        pass
    return _state_dict_digest(model)


def _files_digest(files: list[Path], memo: Path | None) -> str:
    known = _read_memo(memo)
    digests = {}
    for path in files:
        stat, name = path.stat(), str(path.resolve())
        entry = known.get(name)
        if not isinstance(entry, dict) or (entry.get("size"), entry.get("mtime_ns")) != (
            stat.st_size,
            stat.st_mtime_ns,
        ):
            entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(path)}
            known[name] = entry
        digests[path.name] = entry["sha256"]
    _write_memo(memo, known)
    return _digest(json.dumps(digests, sort_keys=True))


def _state_dict_digest(model) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _read_memo(memo: Path | None) -> dict:
    try:
        known = json.loads(memo.read_text()) if memo is not None else {}
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write_memo(memo: Path | None, known: dict) -> None:
    if memo is not None and known != _read_memo(memo):
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(memo, json.dumps(known, indent=1).encode())
        except OSError:  # a read-only store: hash again next time
            pass
