"""Tensors stored coded, for the layers of a document cache whose storage really shrinks (KV-Kaizen,
SeKV's host copies): group-quantised codes (``QuantizedTensor``), rank-``r`` factors
(``LowRankTensor``) and 16-bit copies (``HalfTensor``). Each has ``encode``, ``decode``,
``decode_into`` (into a caller's buffer), ``shape``, ``device`` and ``nbytes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from semanticache_rag.dequantize import decode_groups_into, three_bit_words


def nbytes_of(*tensors: torch.Tensor | None) -> int:
    """Bytes held by ``tensors`` (``None`` counts as none)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def half_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit float type coded tensors store: ``dtype`` itself when it has 16 bits, else float16."""
    return dtype if dtype.itemsize <= 2 else torch.float16


def _fp16_toward(x: torch.Tensor, direction: float) -> torch.Tensor:
    """``x`` (fp32) rounded to fp16, one step further toward ``direction`` (+-inf) where needed.

    So that ``result <= x`` (``direction=-inf``) or ``result >= x`` (``+inf``): the quantisation
    range then covers every element, and no code is clipped.
    """
    half = x.half()
    wrong = half.float() > x if direction < 0 else half.float() < x
    return torch.where(wrong, torch.nextafter(half, torch.full_like(half, direction)), half)


BITS = (3, 4, 8)  # code widths of QuantizedTensor
_THREE_BIT_SHIFTS = torch.arange(0, 24, 3, dtype=torch.int32)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A (1, H, L, D) tensor as ``bits``-bit codes with an fp16 scale and minimum per group along D.

    Asymmetric quantisation per group of ``group_size`` channels of one entry:
    ``x ~ code * scale + minimum`` with ``scale = (max - min) / (2**bits - 1)``, so every element is
    within ``scale / 2`` of its value (at 8 bits that is at most ``absmax / 127 / 2``). The minimum
    is rounded down and the scale up to fp16, so the bound holds for the stored values. 4-bit
    codes are packed two per byte, 3-bit codes eight per three bytes (KIVI, Liu et al. 2024,
    https://arxiv.org/abs/2402.02750, uses the same per-group layout).

    Attributes
    ----------
    codes : Tensor (1, H, L, D * bits / 8) uint8
    scales, minimums : Tensor (1, H, L, D / group_size) float16
    """

    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    bits: int
    dtype: torch.dtype

    @classmethod
    def encode(cls, x: torch.Tensor, bits: int, group_size: int) -> QuantizedTensor:
        if bits not in BITS or x.shape[-1] % group_size or group_size % 2 or (bits == 3 and x.shape[-1] % 8):
            raise ValueError(
                f"bits must be one of {BITS}; an even group_size (3 bits: and 8) must divide {x.shape[-1]} channels"
            )
        levels = 2**bits - 1
        groups = x.float().unflatten(-1, (-1, group_size))  # (1, H, L, D / G, G)
        minimums = _fp16_toward(groups.amin(-1), float("-inf"))
        scales = _fp16_toward((groups.amax(-1) - minimums.float()) / levels, float("inf"))
        safe = torch.where(scales > 0, scales.float(), 1.0)
        codes = ((groups - minimums.float()[..., None]) / safe[..., None]).round_().clamp_(0, levels)
        codes = codes.to(torch.uint8).flatten(-2)
        if bits == 4:  # two codes per byte: even channels in the low nibble
            codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        elif bits == 3:  # eight codes in 24 bits, the first channel lowest, stored as three bytes
            words = (codes.unflatten(-1, (-1, 8)).int() << _THREE_BIT_SHIFTS).sum(-1, dtype=torch.int32)
            codes = torch.stack([(words >> shift) & 255 for shift in (0, 8, 16)], dim=-1).to(torch.uint8).flatten(-2)
        return cls(codes, scales, minimums, bits, x.dtype)

    def take(self, index: torch.Tensor) -> QuantizedTensor:
        """The entries ``index`` (along the second-to-last dimension), still coded."""
        codes, scales, minimums = (
            t.index_select(-2, index.to(t.device)) for t in (self.codes, self.scales, self.minimums)
        )
        return QuantizedTensor(codes, scales, minimums, self.bits, self.dtype)

    def unpacked(self) -> torch.Tensor:
        """The codes one per channel (1, H, L, D) uint8."""
        codes = self.codes
        if self.bits == 4:
            return torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2)
        if self.bits == 3:
            return ((three_bit_words(codes)[..., None] >> _THREE_BIT_SHIFTS) & 7).to(torch.uint8).flatten(-2)
        return codes

    def decode(self) -> torch.Tensor:
        return self.decode_into(torch.empty(self.shape, dtype=torch.float32, device=self.device)).to(self.dtype)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` written into ``out`` (same shape; values bit for bit equal)."""
        if out.dtype != torch.float32:  # the arithmetic is fp32 either way; keep one rounding
            return out.copy_(self.decode())
        return decode_groups_into(self.codes, self.scales, self.minimums, self.bits, out)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:-1], self.codes.shape[-1] * 8 // self.bits))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.codes, self.scales, self.minimums)


@dataclass(frozen=True, eq=False)
class LowRankTensor:
    """A (1, H, L, D) tensor as, per head, coefficients (L, r) @ basis (r, D) (truncated SVD).

    The truncated SVD is the best rank-``r`` approximation in the Frobenius norm (Eckart-Young);
    at ``r = min(L, D)`` it is exact up to rounding. Factors are stored in 16 bits.
    """

    coefficients: torch.Tensor  # (1, H, L, r)
    basis: torch.Tensor  # (1, H, r, D)
    dtype: torch.dtype

    @classmethod
    def encode(cls, x: torch.Tensor, rank: int) -> LowRankTensor:
        rank = min(rank, x.shape[2], x.shape[3])
        u, s, vh = torch.linalg.svd(x.float(), full_matrices=False)
        storage = half_dtype(x.dtype)
        coefficients = (u[..., :rank] * s[..., None, :rank]).to(storage)
        return cls(coefficients, vh[..., :rank, :].to(storage), x.dtype)

    def decode(self) -> torch.Tensor:
        return torch.matmul(self.coefficients.float(), self.basis.float()).to(self.dtype)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` written into ``out``."""
        if out.dtype != torch.float32:
            return out.copy_(self.decode())
        return torch.matmul(self.coefficients.float(), self.basis.float(), out=out)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.coefficients.shape[:-1], self.basis.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.coefficients.device

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.coefficients, self.basis)


@dataclass(frozen=True, eq=False)
class HalfTensor:
    """A tensor stored in 16 bits (:func:`half_dtype`) and cast back on access."""

    data: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def encode(cls, x: torch.Tensor) -> HalfTensor:
        return cls(x.to(half_dtype(x.dtype)), x.dtype)

    def decode(self) -> torch.Tensor:
        return self.data.to(self.dtype)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` written into ``out``."""
        return out.copy_(self.data)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.data)


TensorCode = QuantizedTensor | LowRankTensor | HalfTensor
