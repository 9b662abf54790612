"""KV-cache compressors: one file and one dataclass each, registered here."""

from semanticache_rag.compressors.base import CompressionContext, Compressor, NoCompression
from semanticache_rag.compressors.half import HalfCompressor
from semanticache_rag.compressors.kaizen import DEFAULT_OPTIONS, KaizenCompressor
from semanticache_rag.compressors.kara import KaraCompressor
from semanticache_rag.compressors.sekv import SeKVCompressor
from semanticache_rag.compressors.semanticache import SemantiCacheCompressor
from semanticache_rag.compressors.streaming_llm import StreamingLLMCompressor
from semanticache_rag.errors import ConfigError

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        NoCompression,
        HalfCompressor,
        SemantiCacheCompressor,
        SeKVCompressor,
        StreamingLLMCompressor,
        KaizenCompressor,
        KaraCompressor,
    )
}


# What "auto" builds: the compressor that kept answers closest to the full cache at every ratio
# measured (benchmarks/results/ruler_facts): Kaizen's int8/int4 layers alone up to ~0.8 of the bytes
# removed (SemantiCache then merges nothing), SemantiCache's merging of what Kaizen's codes cannot hold
# beyond. There SemantiCache merges as if a quarter of the layers took 3-bit codes and Kaizen's selector
# puts them on the least sensitive layers: at 0.9, 42 / 31 at 4K / 7.5K against 39 / 31 with 4-bit codes
# only (the full cache 50 / 31; 36 questions each, benchmarks/results/ruler_int3_mix). At 0.5 and 0.75
# the default model's sensitivity table chooses the same layers with or without int3 (a model without a
# table is ranked by reconstruction error, and may take 3-bit codes there).
AUTO = "kaizen+semanticache"
AUTO_OPTIONS: dict = {"options": (*DEFAULT_OPTIONS, "int3"), "lowest_share": 0.25}


def make_compressor(name: str, compression_ratio: float | None = None, **options) -> Compressor:
    """Build a registered compressor by name (as the CLI's ``--compression`` does).

    ``compression_ratio=None`` keeps the compressor's default ratio. ``"kaizen+NAME"`` is Kaizen
    storing the entries of compressor ``NAME`` (``"kaizen+semanticache"``), given as an instance.
    ``"auto"`` is the best measured compressor for the ratio (:data:`AUTO` with :data:`AUTO_OPTIONS`,
    which ``options`` may override).
    """
    if name == "auto":
        name, options = AUTO, {**AUTO_OPTIONS, **options}
    if name.startswith("kaizen+"):
        name, options["inner"] = "kaizen", make_compressor(name.removeprefix("kaizen+"))
    if name not in COMPRESSORS:
        raise ConfigError(f"unknown compression {name!r}; choose one of {sorted([*COMPRESSORS, 'auto', AUTO])}")
    if compression_ratio is not None:
        options["compression_ratio"] = compression_ratio
    return COMPRESSORS[name](**options)


__all__ = [
    "AUTO",
    "AUTO_OPTIONS",
    "COMPRESSORS",
    "CompressionContext",
    "KaraCompressor",
    "Compressor",
    "HalfCompressor",
    "KaizenCompressor",
    "NoCompression",
    "SeKVCompressor",
    "SemantiCacheCompressor",
    "StreamingLLMCompressor",
    "make_compressor",
]
