"""KV-Kaizen: each layer's precision, rank and depth, chosen to fit the cache in one byte budget.

Per layer, the keys and values are stored as they are (``"fp"``), in 16 bits (``"fp16"``),
quantised to 8, 4 or 3 bits with an fp16 scale and minimum per group of ``group_size``
channels (``"int8"``, ``"int4"``, ``"int3"``), as a rank-``r`` factorisation per head
(``"rank32"``), or not at all: the layer attends to the previous layer's cache (``"share"``,
training-free cross-layer sharing as in MiniCache, Liu et al. 2024,
https://arxiv.org/abs/2405.14366). Storage: :mod:`semanticache_rag.kv`.

The selector is calibration-based. Each option of each layer has an exact cost in bytes and a
*sensitivity*: the KL divergence of the model's next-token distributions, full cache vs that one
layer changed, measured once per model on calibration text
(:mod:`~semanticache_rag.compressors.kaizen_calibration`). Sensitivities are taken to add up
across layers (the usual assumption of mixed-precision search), so a greedy solves the budget:
from the full cache, apply the change that adds the least sensitivity per byte saved until the
cache fits, then spend the bytes left on the changes that remove the most sensitivity per byte.
Without a calibration table for the model, the sensitivity is the relative reconstruction error
of each layer's keys and values on the document itself.

With ``inner="semanticache"`` the document is first merged into semantic cores by that compressor
and Kaizen stores the cores (the sizes stay exact integers); one budget covers both.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from semanticache_rag.compressors.base import CompressionContext, Compressor
from semanticache_rag.errors import ConfigError
from semanticache_rag.kv import CodedLayerKV, LayerKV, SharedLayerKV
from semanticache_rag.tensor_codes import HalfTensor, LowRankTensor, QuantizedTensor, TensorCode
from semanticache_rag.tensor_codes import half_dtype as _half

logger = logging.getLogger(__name__)

DEFAULT_OPTIONS = ("fp16", "int8", "int4", "rank32", "rank16", "share")
_OPTION = re.compile(r"fp16|int8|int4|int3|rank[1-9][0-9]*|share")
TABLE_FORMAT = 1
_PACKAGED_TABLES = Path(__file__).resolve().parent.parent / "data"
_NO_INNER = ("kaizen", "sekv", "fp16")  # sekv keeps per-question state beside its cache; fp16 codes its rows


def option_nbytes(option: str, layer: LayerKV, group_size: int) -> int:
    """Exact bytes of ``layer`` stored with ``option`` (what :func:`encode_layer` builds)."""
    if option == "share":
        return 0
    _, heads, length, dim = layer.keys.shape
    elements, half = heads * length * dim, _half(layer.keys.dtype).itemsize
    if option == "fp":
        per_tensor = elements * layer.keys.element_size()
    elif option == "fp16":
        per_tensor = elements * half
    elif option in ("int8", "int4", "int3"):
        per_tensor = elements * int(option[3:]) // 8 + heads * length * (dim // group_size) * 4
    else:
        rank = min(int(option[4:]), length, dim)
        per_tensor = heads * (length + dim) * rank * half
    sizes = 0 if layer.sizes is None else layer.sizes.numel() * layer.sizes.element_size()
    return 2 * per_tensor + sizes


def encode_layer(option: str, layer: LayerKV, previous, group_size: int):
    """``layer`` stored with ``option``; ``previous`` is the stored layer below (for ``"share"``)."""
    if option == "fp":
        return layer
    if option == "share":
        return SharedLayerKV(previous)
    code: Callable[[torch.Tensor], TensorCode]
    if option == "fp16":
        code = HalfTensor.encode
    elif option in ("int8", "int4", "int3"):
        code = functools.partial(QuantizedTensor.encode, bits=int(option[3:]), group_size=group_size)
    else:
        code = functools.partial(LowRankTensor.encode, rank=int(option[4:]))
    return CodedLayerKV(code(layer.keys), code(layer.values), layer.sizes)


def layer_option(layer) -> str:
    """The option a stored layer was built with (``"fp"``, ``"int8"``, ``"rank32"``, ``"share"``...)."""
    if isinstance(layer, SharedLayerKV):
        return "share"
    if not isinstance(layer, CodedLayerKV):
        return "fp"
    code = layer.key_code
    if isinstance(code, QuantizedTensor):
        return f"int{code.bits}"
    return f"rank{code.basis.shape[-2]}" if isinstance(code, LowRankTensor) else "fp16"


def _fits_half(layer: LayerKV, option: str) -> bool:
    """fp16 codes, scales and factors (up to ``sqrt(D)`` times an element) stay finite."""
    if option in ("fp", "share") or _half(layer.keys.dtype) != torch.float16:
        return True
    bound = torch.finfo(torch.float16).max / math.sqrt(layer.keys.shape[-1])
    return max(float(layer.keys.abs().max()), float(layer.values.abs().max())) < bound


def reconstruction_errors(layers, options, group_size: int) -> list[dict[str, float]]:
    """Per layer and option, ||KV - stored KV||^2 / ||KV||^2 (the selector's fallback sensitivity)."""
    table = []
    for i, layer in enumerate(layers):
        keys, values = layer.keys.float(), layer.values.float()
        norm = float(keys.square().sum() + values.square().sum()) or 1.0
        row = {}
        for option in options:
            if option == "share":
                if i == 0 or layers[i - 1].keys.shape != keys.shape:
                    continue
                stored = layers[i - 1]
            else:
                stored = encode_layer(option, layer, None, group_size)
            error = (stored.keys.float() - keys).square().sum() + (stored.values.float() - values).square().sum()
            row[option] = float(error) / norm
        table.append(row)
    return table


def _shareable(i: int, choice: list[str]) -> bool:
    # A shared layer reads its neighbour's own storage: no chains of shared layers.
    return i > 0 and choice[i - 1] != "share" and (i + 1 == len(choice) or choice[i + 1] != "share")


def _best_move(costs, sensitivity, choice, slack: int | None = None) -> tuple[int, str] | None:
    """The change with the least sensitivity added per byte saved (the most removed per byte spent).

    Without ``slack``, changes that save bytes; with it, changes that lower the sensitivity and
    cost at most ``slack`` more bytes.
    """
    best, best_rate = None, math.inf
    for i, (cost, sens) in enumerate(zip(costs, sensitivity)):
        now = choice[i]
        for option, value in sens.items():
            if option == now or not math.isfinite(value) or (option == "share" and not _shareable(i, choice)):
                continue
            saved, added = cost[now] - cost[option], value - sens[now]
            if (saved <= 0) if slack is None else (added >= 0 or -saved > slack):
                continue
            rate = added / max(abs(saved), 1)
            if rate < best_rate:
                best, best_rate = (i, option), rate
    return best


def select_options(costs: list[dict[str, int]], sensitivity: list[dict[str, float]], budget: int) -> list[str]:
    """One option per layer with total cost <= ``budget``, by greedy on sensitivity per byte.

    ``costs[i]`` and ``sensitivity[i]`` map layer ``i``'s options to bytes and to sensitivity;
    both hold ``"fp"`` (sensitivity 0). Options missing from ``sensitivity`` are not used.

    Raises
    ------
    ConfigError
        No choice of options fits the budget.
    """
    choice = ["fp"] * len(costs)
    sensitivity = [{"fp": 0.0, **row} for row in sensitivity]
    total = sum(cost["fp"] for cost in costs)
    while total > budget:  # -- shrink: least damage per byte saved
        move = _best_move(costs, sensitivity, choice)
        if move is None:
            raise ConfigError(
                f"the budget of {budget:,} bytes is below what the options can reach ({total:,} bytes); "
                "lower compression_ratio or allow more options"
            )
        i, option = move
        total -= costs[i][choice[i]] - costs[i][option]
        choice[i] = option
    while True:  # -- refill: spend the bytes left on the largest fidelity gains per byte
        move = _best_move(costs, sensitivity, choice, slack=budget - total)
        if move is None:
            return choice
        i, option = move
        total -= costs[i][choice[i]] - costs[i][option]
        choice[i] = option


def model_identity(context: CompressionContext) -> str:
    """The model a document was read with, as its tokenizer names it (a local directory's name)."""
    return Path(str(getattr(context.tokenizer, "name_or_path", "") or "")).name


def table_path(model: str, folder: Path | None = None) -> Path:
    """Where the sensitivity table of ``model`` lives (the user's calibrations under ``home_dir()``)."""
    if folder is None:
        from semanticache_rag.models import home_dir

        folder = home_dir() / "kaizen"
    return folder / f"kaizen-{model}.json"


def check_table(table: dict, layers, options, group_size: int) -> str | None:
    """Why ``table`` does not fit these layers and options, or ``None`` when it does."""
    _, heads, _, dim = layers[0].keys.shape
    expected = {
        "format": TABLE_FORMAT,
        "num_layers": len(layers),
        "kv_heads": heads,
        "head_dim": dim,
        "dtype": str(layers[0].keys.dtype).removeprefix("torch."),
        "group_size": group_size,
    }
    for key, value in expected.items():
        if table.get(key) != value:
            return f"its {key} is {table.get(key)!r}, not {value!r}"
    missing = sorted(set(options) - set(table.get("options", [])))
    return f"it has no sensitivity for {missing}" if missing else None


def load_table(path: Path) -> dict:
    """A sensitivity table written by :func:`~semanticache_rag.compressors.kaizen_calibration.calibrate`."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the Kaizen calibration {str(path)!r}: {exc}") from exc


@dataclass(frozen=True)
class KaizenCompressor(Compressor):
    """Choose each layer's storage (precision, rank or sharing) so that the cache fits one budget.

    Attributes
    ----------
    compression_ratio : float
        Fraction of the full cache's bytes to remove, in [0, 1): the cache keeps at most
        ``(1 - compression_ratio)`` of them (entries and bytes agree for the other compressors).
    budget_bytes : int or None
        The budget in bytes, instead of a ratio.
    options : tuple of str
        What a layer may become besides staying as it is: ``"fp16"``, ``"int8"``, ``"int4"``, ``"int3"``,
        ``"rank<r>"`` and ``"share"`` (use the previous layer's cache). ``"int3"`` is not among the
        defaults (``auto`` adds it, with ``lowest_share=0.25``): on every layer it lets ``auto`` at 0.9
        merge fewer entries, which scored 50 against 39 at 4K (the full cache 50) but 19 against 31
        at 7.5K (benchmarks/results/ruler_int3).
    group_size : int
        Channels per quantisation group (one fp16 scale and minimum each): even, and a divisor of
        the head dimension, or larger than it (then a group is a whole head).
    calibration : str or None
        ``"auto"``: the model's sensitivity table (:func:`table_path`, then the packaged one) when
        there is one, else reconstruction error on the document; a path: that table; ``None``:
        reconstruction error.
    inner : Compressor, str or None
        A compressor to run first (``SemantiCacheCompressor()`` or ``"semanticache"``); Kaizen then
        stores its entries. Its ratio is ``inner_ratio``, or chosen from the budget.
    inner_ratio : float or None
        The inner compressor's ratio; ``None`` lets it remove only what Kaizen's lowest precision
        cannot (on the default model int4 changes answers far less than merging tokens does).
    merge_group_size : int or None
        ``group_size`` when the inner compressor must merge entries to fit the budget (``inner_ratio``
        ``None`` and Kaizen's lowest precision not enough): coarser scales leave bytes for more
        entries. ``None`` (the default): ``group_size`` always. Measured on RULER-style tasks with
        ``auto`` at 0.9 (36 questions per length; benchmarks/results/ruler_group_size): 64 channels
        scored 44 against 39 at 4K (the full cache 50) but 19 against 31 at 7.5K (the full cache 31;
        it loses codes), so it stays off.
    lowest_share : float
        When the inner compressor must merge entries: the share of layers its ratio assumes at
        Kaizen's lowest precision, in (0, 1]; the rest at the next one up. 1 (the default) merges
        only what the lowest precision everywhere cannot hold; with ``"int3"`` among the options,
        less merges fewer entries and lets the selector put 3-bit codes on the least sensitive
        layers and 4-bit codes on the others. ``auto`` at 0.9 (36 questions per length;
        benchmarks/results/ruler_int3_mix): 0.25 scored 42 / 31 at 4K / 7.5K, 0.5 44 / 28, 1 50 / 19,
        int4 alone 39 / 31 (the full cache 50 / 31).
    """

    name: ClassVar[str] = "kaizen"
    compression_ratio: float = 0.5
    budget_bytes: int | None = None
    options: tuple[str, ...] = DEFAULT_OPTIONS
    group_size: int = 32
    calibration: str | None = "auto"
    inner: Compressor | str | None = None
    inner_ratio: float | None = None
    merge_group_size: int | None = None
    lowest_share: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        for option in self.options:
            if not isinstance(option, str) or not _OPTION.fullmatch(option):
                raise ConfigError(
                    f"unknown Kaizen option {option!r}; use fp16, int8, int4, int3, rank<r> (r >= 1) or share"
                )
        for size in (self.group_size, self.merge_group_size):
            if size is not None and (size < 2 or size % 2):
                raise ConfigError(f"group_size and merge_group_size must be even numbers >= 2, got {size!r}")
        if not 0 < self.lowest_share <= 1:
            raise ConfigError(f"lowest_share must be in (0, 1], got {self.lowest_share!r}")
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ConfigError(f"budget_bytes must be >= 0, got {self.budget_bytes!r}")
        if self.inner is not None:
            from semanticache_rag.compressors import COMPRESSORS

            allowed = sorted(set(COMPRESSORS) - {"none", *_NO_INNER})
            name = self.inner.name if isinstance(self.inner, Compressor) else self.inner
            if name not in allowed:
                raise ConfigError(f"inner compressor {name!r} cannot be wrapped; choose one of {allowed}")
        if self.inner_ratio is not None and (self.inner is None or not 0 <= self.inner_ratio < 1):
            raise ConfigError(f"inner_ratio must be in [0, 1) and needs an inner compressor, got {self.inner_ratio!r}")

    @property
    def needs_surprisal(self) -> bool:  # type: ignore[override]
        return self.inner is not None and self._inner(0.5).needs_surprisal

    def budget(self, full_nbytes: int) -> int:
        """Bytes the stored cache may take, given the full cache's."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        return math.floor((1 - self.compression_ratio) * full_nbytes)

    def compress_cache(self, keys_values, context: CompressionContext):
        full = sum(2 * keys.numel() * keys.element_size() for keys, _ in keys_values)
        budget, head_dim = self.budget(full), keys_values[0][0].shape[-1]
        group = self.group_for(head_dim)
        kept = budget / full if full else 1.0
        if self.merge_group_size is not None and self._merged_share(keys_values, kept, group) > 0:
            group = self.group_for(head_dim, self.merge_group_size)
        layers = self._inner_layers(keys_values, context, kept, group)
        costs = [{o: option_nbytes(o, layer, group) for o in ("fp", *self.options)} for layer in layers]
        sensitivity = self._sensitivity(layers, context, group)
        for layer, row in zip(layers, sensitivity):  # fp16 storage must stay finite
            for option in [o for o in row if not _fits_half(layer, o)]:
                del row[option]
        choice = select_options(costs, sensitivity, budget)
        stored: list = []
        for index, option in enumerate(choice):
            stored.append(encode_layer(option, layers[index], stored[-1] if stored else None, group))
            if context.release_layers:  # the full layer's last references: its codes replace it in memory
                layers[index] = keys_values[index] = None
        counts = ", ".join(f"{option} x{n}" for option, n in Counter(choice).items())
        logger.info("Kaizen layers: %s; %s of %s bytes", counts, f"{sum(s.nbytes for s in stored):,}", f"{budget:,}")
        return tuple(stored), None

    def group_for(self, head_dim: int, size: int | None = None) -> int:
        """Channels per quantisation group (``size``, default :attr:`group_size`) for heads of ``head_dim``."""
        size = self.group_size if size is None else size
        group = min(size, head_dim)
        if head_dim % group:
            raise ConfigError(f"group_size={size} does not divide the head dimension {head_dim}")
        return group

    def compress_document(self, keys_values, context: CompressionContext):
        return self.compress_cache(keys_values, context)[0]

    def compress(self, keys, values, context, plan):
        raise NotImplementedError("Kaizen chooses all layers together under one budget: use compress_cache")

    def _inner(self, ratio: float) -> Compressor:
        if isinstance(self.inner, Compressor):
            return dataclasses.replace(self.inner, compression_ratio=ratio)
        from semanticache_rag.compressors import make_compressor

        return make_compressor(str(self.inner), ratio)

    def _merged_share(self, keys_values, kept: float, group: int) -> float:
        """The inner compressor's ratio when it is chosen from the budget: the share of entries that
        Kaizen's lowest precision cannot hold in ``kept`` of the full bytes (0: no merging needed)."""
        if self.inner is None or self.inner_ratio is not None:
            return 0.0
        keys = keys_values[0][0]
        sizes = torch.ones(keys.shape[:3], dtype=torch.int16)  # what merged entries add
        precisions: list[str] = [o for o in ("int3", "int4", "int8", "fp16") if o in self.options] or ["fp"]
        layer = LayerKV(keys, keys, sizes)
        nbytes = [option_nbytes(option, layer, group) for option in precisions[:2]]
        lowest, above = nbytes[0], nbytes[-1]  # the next precision up (the lowest when it is the only one)
        per_layer = self.lowest_share * lowest + (1 - self.lowest_share) * above
        tokens = keys.shape[2]  # entries that precision affords, rounded down
        return max(0.0, 1 - math.floor(kept * 2 * keys.nbytes / per_layer * tokens) / tokens)

    def _inner_layers(self, keys_values, context, kept: float, group: int) -> list:
        ratio = self.inner_ratio
        if ratio is None and self.inner is not None:
            ratio = self._merged_share(keys_values, kept, group)
        if self.inner is None or not ratio:
            return [LayerKV(keys, values) for keys, values in keys_values]
        layers, _ = self._inner(ratio).compress_cache(keys_values, context)
        return list(layers)

    def _sensitivity(self, layers, context: CompressionContext, group: int) -> list[dict[str, float]]:
        table = self._calibration_table(layers, context, group)
        if table is None:
            return reconstruction_errors(layers, self.options, group)
        return [{o: float(row[o]) for o in self.options if row.get(o) is not None} for row in table["sensitivity"]]

    def _calibration_table(self, layers, context: CompressionContext, group: int) -> dict | None:
        if self.calibration is None or not layers:
            return None
        if self.calibration != "auto":
            table = load_table(Path(self.calibration))
            problem = check_table(table, layers, self.options, group)
            if problem:
                raise ConfigError(f"the Kaizen calibration {self.calibration!r} does not fit: {problem}")
            return table
        model = model_identity(context)
        for path in (table_path(model), table_path(model, _PACKAGED_TABLES)):
            if model and path.is_file():
                try:
                    table = load_table(path)
                except ConfigError as exc:  # a damaged user calibration: the packaged one, or the fallback
                    logger.warning(
                        "%s; not used (python -m semanticache_rag.compressors.kaizen_calibration makes it again)", exc
                    )
                    continue
                problem = check_table(table, layers, self.options, group) if isinstance(table, dict) else "not a table"
                if problem is None:
                    return table
                logger.info("Kaizen calibration %s not used: %s", path, problem)
        return None
