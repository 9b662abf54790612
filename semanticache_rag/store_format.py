"""What a document cache store keeps on disk, and how it is written and read back safely.

A cache is stored as two files named by its id, the hex SHA-256 of its
:class:`~semanticache_rag.store_key.CacheKey`:

- ``<id>.safetensors``: the tensors (safetensors, so loading a file can never run code):
  ``prefix_ids``, ``token_pages``, ``layers.<i>.keys`` / ``.values`` / ``.sizes`` and, for
  compressors that zoom in per question, ``zoom.<name>``. Layers that KV-Kaizen stored coded keep
  their codes (``layers.<i>.keys.codes`` / ``.scales`` / ...; int8/int4, low-rank or 16-bit), and
  layers that share a neighbour's cache store nothing, so a reloaded cache is as small as it was.
- ``<id>.json``: the manifest: the full key, what the cache stands for (document, pages, tokens,
  bytes, ratio, model, compressor, timings, creation time), how each layer is stored and the
  SHA-256 of the tensor file.

Loading checks the manifest's key against the wanted one, the tensor file against the checksum
and the tensors against the model's shape; anything else raises :class:`EntryRejected`.
Extracted document texts are kept beside the entries (:mod:`semanticache_rag.store_documents`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from filelock import FileLock
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from semanticache_rag.cache import DocumentCache, ModelSpec
from semanticache_rag.documents import Document
from semanticache_rag.kv import CodedLayerKV, LayerKV, SharedLayerKV
from semanticache_rag.tensor_codes import BITS, HalfTensor, LowRankTensor, QuantizedTensor

if TYPE_CHECKING:
    from semanticache_rag.store_key import CacheKey

logger = logging.getLogger("semanticache_rag.store")

FORMAT_NAME = "semanticache-rag document cache"
FORMAT_VERSION = 3  # 2: coded and shared layers stored as they are; 3: long documents as sections
TMP_PREFIX = ".tmp-"
ENTRY_ID = re.compile(r"[0-9a-f]{64}")  # the only names entry files have

# Everything that a corrupt, truncated, mismatched or hand-made entry can raise while loading.
LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, RuntimeError, ImportError, SafetensorError)


class EntryRejected(Exception):
    """A stored entry that must not be used (the message says why)."""


def package_version() -> str:
    import semanticache_rag  # here, not at import: this module is imported while the package initialises

    return semanticache_rag.__version__


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


@contextlib.contextmanager
def entry_lock(path: Path, timeout_s: float):
    """Hold the file lock at ``path`` (waiting at most ``timeout_s``), or go on without it when it
    cannot be had (read-only store, timeout): correctness never depends on the lock, only the
    work done once does."""
    lock = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(path, timeout=timeout_s)
        lock.acquire()
    except OSError as exc:
        logger.debug("going on without the lock %s: %s", path, exc)
        lock = None
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


@contextlib.contextmanager
def lock_if_free(path: Path):
    """Hold the file lock at ``path`` for the block if no reader holds it now: yields True (held, so
    no reader can start until the block ends) or False (a reader has it). Deleting under it closes
    the window a look-then-delete would leave open."""
    try:
        lock = FileLock(path, timeout=0)
        lock.acquire()
    except OSError:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def remove_leftovers(directory: Path, older_than_s: float, last_used: float) -> None:
    """Delete what crashed writers left (temporary files, tensor files without a manifest) and
    extracted texts unused since well before ``last_used`` (the least recently used entry's use)."""
    cutoff = time.time() - older_than_s
    for folder in (directory, directory / "documents"):
        with contextlib.suppress(OSError):
            for path in folder.iterdir():
                if path.name.startswith(TMP_PREFIX):
                    stale = cutoff
                elif folder != directory:  # an extracted text
                    stale = last_used - older_than_s if path.suffix == ".json" else -math.inf
                else:
                    orphan = path.suffix == ".safetensors" and not path.with_suffix(".json").exists()
                    stale = cutoff if orphan and ENTRY_ID.fullmatch(path.stem) else -math.inf
                with contextlib.suppress(OSError):
                    if path.stat().st_mtime < stale:
                        path.unlink()


# -- cache <-> tensors + manifest -----------------------------------------------------------


def cache_tensors(cache: DocumentCache) -> dict[str, torch.Tensor]:
    """The cache's tensors by name, on the CPU, contiguous and not sharing memory (safetensors needs both)."""
    tensors = {"prefix_ids": cache.prefix_ids, "token_pages": cache.token_pages}
    for i, layer in enumerate(cache.layers):
        tensors.update({f"layers.{i}.{name}": t for name, t in _layer_parts(layer, cache.layers)[1].items()})
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


_CODES = {cls.__name__: cls for cls in (QuantizedTensor, LowRankTensor, HalfTensor)}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _layer_parts(layer, layers) -> tuple[dict, dict[str, torch.Tensor]]:
    """How one layer is stored (a JSON record for the manifest) and its tensors by name."""
    if isinstance(layer, SharedLayerKV):
        source = next((j for j, other in enumerate(layers) if other is layer.source), None)
        if source is None:
            raise TypeError("a shared layer's source is not a layer of the same cache")
        return {"kind": "shared", "source": source}, {}
    sizes = {} if layer.sizes is None else {"sizes": layer.sizes}
    if isinstance(layer, CodedLayerKV):
        (key_meta, keys), (value_meta, values) = _code_parts(layer.key_code), _code_parts(layer.value_code)
        tensors = {**{f"keys.{n}": t for n, t in keys.items()}, **{f"values.{n}": t for n, t in values.items()}}
        return {"kind": "coded", "keys": key_meta, "values": value_meta}, {**tensors, **sizes}
    return {"kind": "plain"}, {"keys": layer.keys, "values": layer.values, **sizes}


def _code_parts(code) -> tuple[dict, dict[str, torch.Tensor]]:
    meta, tensors = {"code": type(code).__name__}, {}
    for field in fields(code):
        value = getattr(code, field.name)
        if isinstance(value, torch.Tensor):
            tensors[field.name] = value
        else:
            meta[field.name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    return meta, tensors


def _code_from_parts(meta: dict, tensors: dict[str, torch.Tensor], prefix: str):
    cls = _CODES[meta["code"]]
    kwargs: dict[str, Any] = {}
    for field in fields(cls):
        if field.name == "dtype":
            kwargs["dtype"] = _DTYPES[meta["dtype"]]
        elif field.name == "bits":
            if meta["bits"] not in BITS:
                raise EntryRejected(f"{prefix}: {meta['bits']!r}-bit codes")
            kwargs["bits"] = meta["bits"]
        else:
            kwargs[field.name] = tensors[f"{prefix}.{field.name}"]
    return cls(**kwargs)


def _summary(cache) -> dict:
    """What a cache (a document read whole, a long one or one section of it) stands for and took."""
    return {
        "tokens": cache.length,
        "nbytes": cache.nbytes,
        "full_nbytes": cache.full_nbytes,
        "entries_removed": cache.entries_removed,
        "bytes_removed": cache.bytes_removed,
        "model_name": cache.model_name,
        "compressor": cache.compressor,
        "prefill_s": cache.prefill_s,
        "compress_s": cache.compress_s,
    }


def cache_record(cache: DocumentCache, tensors_sha256: str, tensors_bytes: int) -> dict:
    """What loading one :class:`DocumentCache` back needs besides its tensor file (see :func:`load_cache`)."""
    return {
        **_summary(cache),
        "layers": len(cache.layers),
        "zoom": cache.zoom is not None,
        "layer_storage": [_layer_parts(layer, cache.layers)[0] for layer in cache.layers],
        "tensors": {"sha256": tensors_sha256, "bytes": tensors_bytes},
    }


def build_manifest(cache, key: CacheKey, records: dict) -> dict:
    """The JSON manifest of an entry (written after its tensor files).

    ``records`` says how to load it: a document read whole, its :func:`cache_record`; a long one,
    ``{"head": record, "sections": [record, ...]}`` (see :mod:`semanticache_rag.store_sections`).
    """
    doc = cache.document
    return {
        "format": FORMAT_NAME,
        "format_version": key.format_version,
        "package_version": key.package_version,
        "id": key.id,
        "key": asdict(key),
        "document": {"name": doc.name, "source": doc.source, "sha256": doc.sha256, "extractor": doc.extractor},
        "pages": doc.total_pages,
        **_summary(cache),
        **records,
        "created": time.time(),
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


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, read in blocks (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[str, int]:
    """Write ``tensors`` as safetensors at ``path`` (temporary file + rename); (SHA-256, bytes).

    The tensors are written from their own memory, one after the other: saving an entry holds
    no serialised copy of it.
    """
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        digest, size = file_sha256(Path(tmp)), os.path.getsize(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return digest, size


def load_cache(manifest: dict, path: Path, document: Document, spec: ModelSpec) -> DocumentCache:
    """Rebuild a :class:`DocumentCache` from its :func:`cache_record` (or a checked manifest that
    holds one) and its tensor file, checked against the record's checksum first and then read one
    tensor at a time (the file is never held in memory besides the tensors it holds).

    Raises
    ------
    EntryRejected
        The file fails its checksum, or the record does not describe it (a format mismatch).
    FileNotFoundError
        The file is missing.
    """
    prefix_ids, token_pages, layers, zoom = _read(manifest, path, spec)
    if prefix_ids.numel() and not -1 <= int(token_pages.min()) <= int(token_pages.max()) < document.total_pages:
        raise EntryRejected("token pages outside the document")
    try:
        model_name, compressor = manifest["model_name"], manifest["compressor"]
        prefill_s, compress_s = float(manifest["prefill_s"]), float(manifest["compress_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise EntryRejected(f"the manifest lacks {exc}") from exc
    return DocumentCache(document, layers, prefix_ids, token_pages, model_name, compressor, prefill_s, compress_s, zoom)


def load_layers(manifest: dict, path: Path, spec: ModelSpec) -> tuple[torch.Tensor, tuple]:
    """The prefix token ids and the layers of a stored cache, checked as :func:`load_cache` checks
    them, without its document (what an engine of another framework attends to: see
    :mod:`semanticache_rag.expansion`). Raises what :func:`load_cache` raises."""
    prefix_ids, _, layers, _ = _read(manifest, path, spec)
    return prefix_ids, layers


def _read(manifest: dict, path: Path, spec: ModelSpec):
    try:
        if file_sha256(path) != manifest["tensors"]["sha256"]:
            raise EntryRejected(f"tensor file checksum mismatch ({path.stat().st_size:,} bytes)")
        with safe_open(str(path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict
        return _rebuild(manifest, tensors, spec)
    except (KeyError, TypeError, IndexError, AttributeError) as exc:  # the manifest names what the file lacks
        raise EntryRejected(f"the manifest does not describe its tensors ({type(exc).__name__}: {exc})") from exc


def _rebuild(manifest: dict, tensors: dict[str, torch.Tensor], spec: ModelSpec):
    """(prefix ids, token pages, layers, zoom state) of a record's tensors, checked against ``spec``."""
    tokens, num_layers = int(manifest["tokens"]), int(manifest["layers"])
    prefix_ids, token_pages = tensors.pop("prefix_ids"), tensors.pop("token_pages")
    if prefix_ids.shape != (tokens,) or token_pages.shape != (tokens,) or prefix_ids.dtype != torch.long:
        raise EntryRejected("prefix tokens do not match the manifest")
    model_layers = spec.empty_layers()  # (1, H_kv, 0, D) each: the shapes this model attends with
    if num_layers != len(model_layers):
        raise EntryRejected(f"{num_layers} layers, the model has {len(model_layers)}")
    storage = manifest.get("layer_storage")
    if not isinstance(storage, list) or len(storage) != num_layers:
        raise EntryRejected("the manifest does not say how each layer is stored")
    layers: list = []
    for i, record in enumerate(storage):
        layers.append(_layer(tensors, i, record, layers, model_layers[i].keys, spec.device))
    zoom = _zoom({k.removeprefix("zoom."): v for k, v in tensors.items() if k.startswith("zoom.")}, manifest)
    if zoom is not None:
        try:
            zoom.check(layers)
        except ValueError as exc:
            raise EntryRejected(f"zoom state: {exc}") from exc
    return prefix_ids, token_pages, tuple(layers), zoom


def _layer(tensors: dict[str, torch.Tensor], i: int, record, earlier: list, like: torch.Tensor, device):
    """Layer ``i`` as ``record`` says it was stored, checked against the model's shape ``like``."""
    kind = record.get("kind") if isinstance(record, dict) else None
    if kind == "shared":
        source = record.get("source")
        if not isinstance(source, int) or not 0 <= source < i:
            raise EntryRejected(f"layer {i}: shares layer {source!r}, which is not below it")
        return SharedLayerKV(earlier[source])
    sizes = tensors.get(f"layers.{i}.sizes")
    if kind == "coded":
        prefix = f"layers.{i}"
        layer = CodedLayerKV(
            _code_from_parts(record["keys"], tensors, f"{prefix}.keys"),
            _code_from_parts(record["values"], tensors, f"{prefix}.values"),
            sizes,
        )
        try:  # decoding once checks every code's tensors fit together
            keys, values = layer.keys, layer.values
        except RuntimeError as exc:  # e.g. 4-bit codes said to be 3-bit: they do not unpack
            raise EntryRejected(f"layer {i}: its codes do not decode ({exc})") from exc
    elif kind == "plain":
        keys, values = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
    else:
        raise EntryRejected(f"layer {i}: unknown storage {kind!r}")
    shape = (1, like.shape[1], keys.shape[2] if keys.dim() == 4 else -1)
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != shape or values.shape[:3] != shape:
        raise EntryRejected(
            f"layer {i}: keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit the model"
        )
    if keys.shape[3] != like.shape[3] or values.shape[3] != like.shape[3]:
        raise EntryRejected(f"layer {i}: head dimension {keys.shape[3]}, the model has {like.shape[3]}")
    if not keys.is_floating_point() or (sizes is not None and sizes.shape != keys.shape[:3]):
        raise EntryRejected(f"layer {i}: bad dtype or sizes")
    sizes = None if sizes is None else sizes.to(device)
    if kind == "coded":
        return CodedLayerKV(_to(layer.key_code, device), _to(layer.value_code, device), sizes)
    return LayerKV(keys.to(device), values.to(device), sizes)


def _to(code, device):
    """A tensor code with its tensors on ``device``."""
    return replace(code, **{name: t.to(device) for name, t in _code_parts(code)[1].items()})


def _zoom(state: dict[str, torch.Tensor], manifest: dict):
    if not manifest.get("zoom"):
        return None
    from semanticache_rag.compressors.sekv import zoom_from_state_dict  # only caches that zoom need it

    try:
        return zoom_from_state_dict(state)
    except ValueError as exc:
        raise EntryRejected(f"zoom state: {exc}") from exc
