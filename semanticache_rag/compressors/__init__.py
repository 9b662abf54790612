"""KV-cache compressors: one file and one dataclass each, registered here."""

from semanticache_rag.compressors.base import CompressionContext, Compressor, NoCompression

COMPRESSORS: dict[str, type[Compressor]] = {cls.name: cls for cls in (NoCompression,)}


def make_compressor(name: str, compression_ratio: float = 0.0, **options) -> Compressor:
    """Build a registered compressor by name (as the CLI's ``--compression`` does)."""
    from semanticache_rag.errors import ConfigError

    if name not in COMPRESSORS:
        raise ConfigError(f"unknown compression {name!r}; choose one of {sorted(COMPRESSORS)}")
    if name == "none":
        return NoCompression()
    return COMPRESSORS[name](compression_ratio=compression_ratio, **options)


__all__ = ["COMPRESSORS", "CompressionContext", "Compressor", "NoCompression", "make_compressor"]
