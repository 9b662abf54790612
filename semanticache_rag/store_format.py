"""What a stored document cache is made of: its key, and its tensors and manifest on disk.

A cache is stored as two files named by its id, the hex SHA-256 of its :class:`CacheKey`:

- ``<id>.safetensors``: the tensors (safetensors, so loading a file can never run code):
  ``prefix_ids``, ``token_pages``, ``layers.<i>.keys`` / ``.values`` / ``.sizes`` and, for
  compressors that zoom in per question, ``zoom.<name>``.
- ``<id>.json``: the manifest: the full key, what the cache stands for (document, pages, tokens,
  bytes, ratio, model, compressor, timings, creation time) and the SHA-256 of the tensor file.

Loading checks the manifest's key against the wanted one, the tensor file against the checksum
and the tensors against the model's shape; anything else raises :class:`EntryRejected`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors

from semanticache_rag.documents import Document
from semanticache_rag.engine import DocumentCache
from semanticache_rag.kv import LayerKV

FORMAT_NAME = "semanticache-rag document cache"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

# Everything that a corrupt, truncated, mismatched or hand-made entry can raise while loading.
LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError, ImportError, SafetensorError)


class EntryRejected(Exception):
    """A stored entry that must not be used (the message says why)."""


def package_version() -> str:
    import semanticache_rag  # here, not at import: this module is imported while the package initialises

    return semanticache_rag.__version__


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
        Digest of the model identity: weights, config, dtype, tokenizer, prompt head, prefill chunk
        (see :func:`model_identity`).
    compressor : str
        ``repr`` of the compressor dataclass: its name and full configuration.
    format_version, package_version
        Of the package that wrote the entry; another version never loads it.
    """

    document_sha256: str
    pages_sha256: str
    model_name: str
    model: str
    compressor: str
    format_version: int = FORMAT_VERSION
    package_version: str = field(default_factory=package_version)

    @property
    def id(self) -> str:
        """Hex SHA-256 of the key: the entry's file name (never a user or document string)."""
        return _digest(json.dumps(asdict(self), sort_keys=True))

    @classmethod
    def for_read(cls, engine, document: Document, memo: Path | None = None) -> CacheKey:
        """The key of ``engine.read(document)`` (``memo``: see :func:`model_identity`)."""
        pages = [[p.number, p.label, p.start, p.end] for p in document.pages]
        identity = model_identity(engine, memo)
        return cls(document.sha256, _digest(json.dumps(pages)), engine.model_name, identity, repr(engine.compressor))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# -- model identity ---------------------------------------------------------------------------

_IDENTITIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_identity(engine, memo: Path | None = None) -> str:
    """Digest of what makes ``engine``'s caches: computed once per engine.

    Weights are hashed from the model's files on disk when it was loaded from a local directory
    (SHA-256 of each weight file, memoised in ``memo`` by path, size and modification time, so a
    process pays it once per model file, ~0.7 s for the default model's 540 MB); otherwise from
    the in-memory state dict (names, dtypes, shapes, bytes). Config, dtype, tokenizer, prompt head
    and prefill chunk size are part of the identity too: each changes the cached keys and values.
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
        "config": config,
        "weights": weights_digest(model, memo),
        "tokenizer": _digest(vocab),
        "head": engine.prompt.head,
        "prefill_chunk": engine.prefill_chunk,
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
            entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": _file_digest(path)}
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


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
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


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    Readers see the old file or the new one, never a partial one; a crash leaves only a
    ``.tmp-*`` file, which the store removes later.
    """
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# -- cache <-> tensors + manifest -----------------------------------------------------------


def cache_tensors(cache: DocumentCache) -> dict[str, torch.Tensor]:
    """The cache's tensors by name, on the CPU, contiguous and not sharing memory (safetensors needs both)."""
    tensors = {"prefix_ids": cache.prefix_ids, "token_pages": cache.token_pages}
    for i, layer in enumerate(cache.layers):
        tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"] = layer.keys, layer.values
        if layer.sizes is not None:
            tensors[f"layers.{i}.sizes"] = layer.sizes
    zoom: Any = cache.zoom
    if zoom is not None:
        for name, tensor in zoom.state_dict().items():
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"zoom state {name!r} is a {type(tensor).__name__}, not a tensor")
            tensors[f"zoom.{name}"] = tensor
    out, seen = {}, set()
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out


def build_manifest(cache: DocumentCache, key: CacheKey, tensors_sha256: str, tensors_bytes: int) -> dict:
    """The JSON manifest of an entry (written after its tensor file)."""
    doc = cache.document
    return {
        "format": FORMAT_NAME,
        "format_version": key.format_version,
        "package_version": key.package_version,
        "id": key.id,
        "key": asdict(key),
        "document": {"name": doc.name, "source": doc.source, "sha256": doc.sha256, "extractor": doc.extractor},
        "pages": doc.total_pages,
        "tokens": cache.length,
        "layers": len(cache.layers),
        "nbytes": cache.nbytes,
        "full_nbytes": cache.full_nbytes,
        "compression_ratio": cache.compression_ratio,
        "model_name": cache.model_name,
        "compressor": cache.compressor,
        "prefill_s": cache.prefill_s,
        "compress_s": cache.compress_s,
        "zoom": cache.zoom is not None,
        "created": time.time(),
        "tensors": {"sha256": tensors_sha256, "bytes": tensors_bytes},
    }


def check_manifest(manifest, key: CacheKey) -> None:
    """Raise :class:`EntryRejected` unless ``manifest`` is an entry of exactly ``key``."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise EntryRejected("not a document cache manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise EntryRejected(f"format version {manifest.get('format_version')!r}, this package reads {FORMAT_VERSION}")
    stored = manifest.get("key")
    if stored != asdict(key):
        wrong = sorted(k for k, v in asdict(key).items() if not isinstance(stored, dict) or stored.get(k) != v)
        raise EntryRejected(f"manifest is for another {', '.join(wrong) or 'key'}")


def load_cache(manifest: dict, data: bytes, document: Document, engine) -> DocumentCache:
    """Rebuild a :class:`DocumentCache` from a checked manifest and the tensor file's bytes."""
    if hashlib.sha256(data).hexdigest() != manifest["tensors"]["sha256"]:
        raise EntryRejected(f"tensor file checksum mismatch ({len(data):,} bytes)")
    tensors = load_tensors(data)
    tokens, num_layers = int(manifest["tokens"]), int(manifest["layers"])
    prefix_ids, token_pages = tensors.pop("prefix_ids"), tensors.pop("token_pages")
    if prefix_ids.shape != (tokens,) or token_pages.shape != (tokens,) or prefix_ids.dtype != torch.long:
        raise EntryRejected("prefix tokens do not match the manifest")
    if tokens and not -1 <= int(token_pages.min()) <= int(token_pages.max()) < document.total_pages:
        raise EntryRejected("token pages outside the document")
    model_layers = engine.empty_cache().layers  # (1, H_kv, 0, D) each: the shapes this model attends with
    if num_layers != len(model_layers):
        raise EntryRejected(f"{num_layers} layers, the model has {len(model_layers)}")
    layers = tuple(_layer(tensors, i, model_layers[i].keys, engine.device) for i in range(num_layers))
    zoom = _zoom({k.removeprefix("zoom."): v for k, v in tensors.items() if k.startswith("zoom.")}, manifest)
    return DocumentCache(
        document,
        layers,
        prefix_ids,
        token_pages,
        manifest["model_name"],
        manifest["compressor"],
        float(manifest["prefill_s"]),
        float(manifest["compress_s"]),
        zoom,
    )


def _layer(tensors: dict[str, torch.Tensor], i: int, like: torch.Tensor, device: torch.device) -> LayerKV:
    keys, values = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
    sizes = tensors.get(f"layers.{i}.sizes")
    shape = (1, like.shape[1], keys.shape[2] if keys.dim() == 4 else -1)
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != shape or values.shape[:3] != shape:
        raise EntryRejected(
            f"layer {i}: keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit the model"
        )
    if keys.shape[3] != like.shape[3]:
        raise EntryRejected(f"layer {i}: head dimension {keys.shape[3]}, the model has {like.shape[3]}")
    if not keys.is_floating_point() or (sizes is not None and sizes.shape != keys.shape[:3]):
        raise EntryRejected(f"layer {i}: bad dtype or sizes")
    sizes = None if sizes is None else sizes.to(device)
    return LayerKV(keys.to(device), values.to(device), sizes)


def _zoom(state: dict[str, torch.Tensor], manifest: dict):
    if not manifest.get("zoom"):
        return None
    from semanticache_rag.compressors.sekv import SpanIndex  # only caches that zoom need it

    return SpanIndex.from_state_dict(state)
