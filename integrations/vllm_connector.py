"""A vLLM KV connector that answers requests from stored semanticache-rag caches (no prefill of the document).

Loaded by vLLM itself, through its KV-transfer extension point (nothing of vLLM is patched)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "SemantiCacheConnector",
        "kv_connector_module_path": "semanticache_rag.integrations.vllm_connector",
        "kv_role": "kv_consumer", "kv_connector_extra_config": {"store": "/path/to/store"}}'

(``semanticache-rag vllm-serve`` writes these flags.) A request names a stored cache in
``kv_transfer_params`` and carries its salt (:func:`semanticache_rag.served.request_fields`); its
prompt must start with the cache's prefix tokens. The connector then tells vLLM's scheduler that
those tokens are already computed and, in the worker, writes the cache's expansion (each
SemantiCache core repeated its size times, Kaizen's layers decoded:
:mod:`semanticache_rag.served`) into the request's blocks with the attention backend's own cache
write, before the forward pass that computes the rest of the prompt. vLLM's attention over those
copies is our proportional attention over the compressed cache, so the answers are ours; what is
saved is the document's prefill (and its storage and transfer), not vLLM's KV memory.

Everything else is computed as usual: a request that names no cache, names one that is missing,
damaged, of another model or without a plain form (SeKV, StreamingLLM, a long document's
sections), whose prompt does not start with the cache's tokens, or that lacks the cache's salt
while vLLM's prefix cache is on (its blocks would then be found by requests that did not ask for
an approximate cache). Each such case is logged once per cache with the reason. A cache that
fails to load in the worker after the scheduler accepted it reports its blocks as failed loads,
which fails the request (vLLM's default ``kv_load_failure_policy="fail"``, which the connector
requires).

A request that also sets ``semanticache_compact`` keeps the cache compressed (Tier 2): its prompt
starts with ``P`` stand-in tokens, one per slot of the cache at compact positions
(:func:`~semanticache_rag.expansion.compact_cache`), the connector writes the cores there and
their ``log s`` into the side table of :mod:`semanticache_rag.integrations.vllm_attention`. Such
a prompt computed as usual would answer from the document's first ``P`` tokens, so a compact
request that cannot be served is claimed anyway and its load failed: it ends with an error.

One worker (no tensor or pipeline parallelism), models whose attention layers are the decoder's
(Llama, Qwen2, Mistral and the like), the CPU and CUDA attention backends that expose
``do_kv_cache_update``; compact caches on the CPU backend only, for models with plain RoPE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from semanticache_rag.cache import ModelSpec
from semanticache_rag.errors import ConfigError
from semanticache_rag.rotation import config_frequencies
from semanticache_rag.served import (
    PrefixCache,
    ServedPrefix,
    ServeError,
    document_salt,
    requested_entry,
    requests_compact,
    slots,
)
from semanticache_rag.store_entries import default_directory

logger = logging.getLogger(__name__)

__all__ = ["SemantiCacheConnector", "SemantiCacheConnectorMetadata"]


@dataclass
class _Load:
    """Write tokens ``start .. end - 1`` of stored cache ``entry_id`` into a request's blocks
    (``compact``: its slots at compact positions; ``fail``: report the blocks as failed instead)."""

    request_id: str
    entry_id: str
    start: int
    end: int
    block_ids: list[int] = field(default_factory=list)
    compact: bool = False
    fail: str | None = None


@dataclass
class SemantiCacheConnectorMetadata(KVConnectorMetadata):
    """What the scheduler tells the worker each step: the loads to do before the forward pass."""

    loads: list[_Load] = field(default_factory=list)


def _plain_rope(model_config, num_layers: int) -> list[torch.Tensor] | None:
    """The serving model's rotary frequencies per layer, for compact caches; ``None`` when its RoPE is
    not plain (compact requests then fail with that reason)."""
    try:
        return [config_frequencies(model_config.hf_config)] * num_layers
    except (ConfigError, AttributeError, TypeError) as exc:
        logger.info("compact caches cannot be served with this model: %s", exc)
        return None


class SemantiCacheConnector(KVConnectorBase_V1):
    """Serves stored document caches to vLLM (``kv_connector_extra_config``: ``store``, the store
    directory; default ``$SEMANTICACHE_STORE`` or the package's default)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ValueError(
                "SemantiCacheConnector serves one worker's full KV (no tensor or pipeline parallelism yet); "
                "run one replica per worker instead (see the README's vLLM section)"
            )
        directory = self._kv_transfer_config.get_from_extra_config("store", None) or default_directory()
        model = vllm_config.model_config
        spec = ModelSpec(
            num_layers=model.get_num_layers(parallel),
            kv_heads=model.get_num_kv_heads(parallel),
            head_dim=model.get_head_size(),
            dtype=model.dtype,
            device=torch.device("cpu"),
        )
        self._prefixes = PrefixCache(directory, spec, inv_freqs=_plain_rope(model, spec.num_layers))
        if self._kv_transfer_config.kv_load_failure_policy != "fail":
            raise ValueError(
                "SemantiCacheConnector needs kv_load_failure_policy='fail' (vLLM's default): a compact request "
                "whose cache cannot be loaded must fail, not be computed from its stand-in prompt"
            )
        self._block_size = vllm_config.cache_config.block_size
        self._salted = bool(vllm_config.cache_config.enable_prefix_caching)
        self._pending: dict[str, _Load] = {}
        self._failed_blocks: set[int] = set()
        self._warned: set[tuple[str, str]] = set()
        self.served_tokens = 0  # prompt tokens written from stored caches by this worker

    # -- scheduler side ------------------------------------------------------------------

    def _warn(self, entry_id: str, reason: str) -> None:
        if (entry_id, reason) not in self._warned:
            self._warned.add((entry_id, reason))
            logger.warning("stored cache %s not used, the prompt is computed as usual: %s", entry_id[:12], reason)

    def _prefix(self, request) -> ServedPrefix | str | None:
        """The stored prefix ``request`` asks for and may be served from; ``None`` when it names none;
        why not, when it cannot be served."""
        params = getattr(request, "kv_transfer_params", None)
        entry_id = requested_entry(params)
        if entry_id is None:
            return None
        compact = requests_compact(params)
        salt = document_salt(entry_id, compact)
        if self._salted and getattr(request, "cache_salt", None) != salt:
            return f"the request lacks cache_salt={salt!r} (prefix caching is on)"
        try:
            prefix = self._prefixes.get(entry_id, compact)
        except ServeError as exc:
            return str(exc)
        if not prefix.matches(request.prompt_token_ids or []):
            return f"the prompt does not start with the cache's {len(prefix.prefix_ids)} prefix tokens"
        return prefix

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        prefix = self._prefix(request)
        if isinstance(prefix, ServedPrefix):
            return max(0, len(prefix.prefix_ids) - num_computed_tokens), False
        if prefix is None:
            return 0, False
        entry_id = requested_entry(request.kv_transfer_params)
        if not requests_compact(request.kv_transfer_params):
            self._warn(entry_id, prefix)  # type: ignore[arg-type]
            return 0, False  # the prompt holds the whole document: vLLM computes it
        # A compact prompt stands in for the document: computed as usual it would answer from its first
        # tokens only. Claim it and fail the load, so the request ends with an error.
        logger.warning("compact request %s fails: stored cache %s: %s", request.request_id, entry_id[:12], prefix)  # type: ignore[index]
        self._pending[request.request_id] = _Load(request.request_id, entry_id, 0, 0, compact=True, fail=prefix)  # type: ignore[arg-type]
        return max(0, len(request.prompt_token_ids or []) - 1 - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id in self._pending:  # a failing load is already pending
            return
        entry_id = requested_entry(request.kv_transfer_params)
        compact = requests_compact(request.kv_transfer_params)
        end = len(self._prefixes.get(entry_id, compact).prefix_ids)  # type: ignore[arg-type]  # checked by _prefix
        load = _Load(request.request_id, entry_id, end - num_external_tokens, end, compact=compact)  # type: ignore[arg-type]
        self._pending[request.request_id] = load

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = SemantiCacheConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
        cached = scheduler_output.scheduled_cached_reqs  # requests resumed after preemption load again
        resumed = getattr(cached, "resumed_req_ids", set())
        for index, request_id in enumerate(getattr(cached, "req_ids", [])):
            blocks = cached.new_block_ids[index] if index < len(cached.new_block_ids) else None
            if request_id not in resumed or blocks is None:  # others get only their newly added blocks here
                continue
            load = self._pending.pop(request_id, None)
            if load is not None:
                load.block_ids = list(blocks[0])  # a resumed request's whole block list
                meta.loads.append(load)
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending.pop(request.request_id, None)
        return False, None

    # -- worker side ---------------------------------------------------------------------

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SemantiCacheConnectorMetadata) or not meta.loads:
            return
        layers = {
            name: layer
            for name, layer in forward_context.no_compile_layers.items()
            if getattr(layer, "kv_cache", None) is not None
            and hasattr(getattr(layer, "impl", None), "do_kv_cache_update")
        }
        for load in meta.loads:
            try:
                if load.fail:
                    raise ServeError(load.fail)
                prefix = self._prefixes.get(load.entry_id, load.compact)
                if load.compact and not all(hasattr(layer.impl, "write_log_sizes") for layer in layers.values()):
                    raise ServeError("vLLM's attention backend is not SemantiCache's (its plugin is not loaded)")
            except ServeError as exc:  # gone or damaged since the scheduler checked it: the request fails
                logger.warning("stored cache %s failed to load (%s)", load.entry_id[:12], exc)
                self._failed_blocks.update(load.block_ids)
                continue
            where = slots(load.block_ids, self._block_size, load.start, load.end)
            for name, layer in layers.items():
                index = extract_layer_index(name)
                keys, values = prefix.layers[index]
                kv_cache = layer.kv_cache
                if isinstance(kv_cache, (list, tuple)):  # one per virtual engine in older versions
                    kv_cache = kv_cache[forward_context.virtual_engine]
                part = slice(load.start, load.end)
                layer.impl.do_kv_cache_update(
                    layer, keys[part].to(kv_cache.dtype), values[part].to(kv_cache.dtype), kv_cache, where
                )
                if prefix.log_sizes is not None:
                    layer.impl.write_log_sizes(kv_cache, where, prefix.log_sizes[index][part])
            self.served_tokens += load.end - load.start

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer was written before the forward pass (a synchronous load)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # documents are read (and stored) by semanticache-rag, not by vLLM

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
