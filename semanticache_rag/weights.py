"""How a model's matrices are stored and multiplied on a CPU: as loaded, fp32, fp16, bf16, int8 or int4.

Answering a question is mostly decoding, and a decode step reads every weight once: with the
default model's 135M parameters in fp32 that is 0.5 GB per token, far more than a compressed
document cache. :func:`convert_weights` swaps the decoder's ``nn.Linear`` modules (and the output
head) for weight-only low-precision ones; the residual stream, the norms, the KV cache and the
attention stay in the model's dtype, only the weight products change:

``"fp32"``
    an fp32 model's own weights (:class:`Fp32Linear`; a tied head stays the embedding table itself): one row (a
    decoding step) multiplied by ``fp32_row_product`` (``kernels/fp32_weights_cpu.cpp``), which streams each row
    once at the memory's speed, many rows by torch's product. The model's arithmetic up to the order of the
    sums, its memory too; what it adds to ``"model"`` (as loaded) is the lean step: on a Llama model every
    decoding step is one C++ call (:mod:`.fused`), where transformers' forward took ~1.8x its time on the
    default model (2 threads).
``"fp16"``
    fp16 weights in fbgemm's packed layout, multiplied by fp32 inputs with fp32 sums
    (``torch.ops.quantized.linear_dynamic_fp16``, what torch's dynamic fp16 quantisation runs): half
    the bytes of fp32 and the fastest decoding step on CPUs without AVX-512 bf16, where every
    other format here is bound by its kernel's arithmetic rather than by memory. The weights are
    rounded to fp16 (11 significant bits; the default model's are Q4_1 values, whose scales GGUF
    stores in fp16), so answers barely move. With many rows (reading) the packed product is as fast
    as fp32's (2 threads, 512-1,024 rows: 0.89-0.94x its time). Needs torch's fbgemm engine (x86 CPUs).
``"bf16"``
    bf16 weights, bf16 products (AVX-512 bf16 where the CPU has it; 2-10x slower than fp32 where not).
``"int8"``
    one int8 per weight and one scale per output row (``torch._weight_int8pack_mm``). A head tied to
    the input embedding is int8 too for decoding, while reading's surprisal multiplies by the
    embedding table (as with fp16 and int4).
``"int4"``
    4-bit codes in groups of 32 along the input, each group with an fp16 scale and minimum: GGUF's
    Q4_1, which is how the default model ships, so the codes, scales and minimums are the GGUF's own
    (:func:`group_codes` finds them again in the dequantised weights, which decode exactly). A head
    tied to the input embedding becomes int8 in groups of 32 with a scale each, GGUF's Q8_0 (the
    default model's head ships so: :class:`GroupedInt8Linear` finds the file's codes exactly), for
    decoding, while reading's surprisal multiplies by the embedding table; an untied head stays bf16
    (as int8 per row it tripled the KL to the fp32 model's next-token distributions). Decoding with int4
    also scores Kaizen's 8/4/3-bit keys against the query rounded to Q8_0, as llama.cpp scores a quantised
    K cache (``kernels/attention_q8.h``; in integers where the CPU has AVX-512 VNNI), and weighs 8/4-bit values
    in integers (``kernels/attention_values_int.h``: weight * scale in 15 bits; AVX-512 VNNI and VBMI).
``"int4-exact"``
    int4's layers (the same codes, scales and minimums) with the rows kept in fp32
    (:class:`ExactInt4Linear`), and a tied head whose weights are Q8_0 values exactly (the default
    model's) as its Q8_0 codes with fp32 scales, the rows in fp32 too (:class:`ExactGroupedInt8Linear`;
    any other head stays as loaded): the fp32 model's arithmetic on the same weights, up to the order
    of the sums, at int4's memory. Kaizen's 8/4-bit keys meet the query as it is: in integers where the CPU
    has AVX-512 VNNI, the query split into 3 pieces of 8-bit codes that keep it to fp32's precision
    (``kernels/attention_q8.h``), as with fp32 weights.

``"auto"``
    ``"int4-exact"`` where that is the model's own arithmetic on its own weights (an fp32 Llama model on the
    CPU whose decoder matrices are all Q4_1 values exactly, as the default model's; the C++ kernels built),
    ``"fp32"`` for another fp32 Llama model on the CPU (the kernels built), else ``"model"``:
    :func:`~semanticache_rag.gguf_codes.auto_weights`. The default of
    :meth:`~semanticache_rag.Engine.from_pretrained`, the command line and the adapters.

Which product runs depends on the format and the rows (C++ kernels from ``kernels/int4_weights_cpu.cpp``,
``kernels/int4_exact_weights_cpu.cpp`` and ``kernels/q8_0_weights_cpu.cpp``, built on first use):

- int4 layers and the Q8_0 head, fewer than :data:`MANY_ROWS` rows (decoding, a question's prompt):
  llama.cpp's arithmetic, each row quantised to Q8_0 and the code products summed as integers
  (AVX-512 VNNI where the CPU has it), each block of codes read once for all the rows; int4-exact
  layers: the fp32 rows times the codes in fp32, each group's codes converted once for all the rows
  (its Q8_0 head: each row in turn);
- int8 layers and heads, one row: the fp32 row times the codes in fp32, in C++; up to
  :data:`MANY_ROWS` rows: torch's int8 CPU kernel on bf16 inputs (its fast path);
- int8/int4 layers, :data:`MANY_ROWS` rows or more (reading a document): the layer's weights are
  decoded to fp32 once per call (exactly the values the few-row products multiply by, in C++ for
  int4) and multiply the fp32 inputs (512 rows of the default model's layers, 2 threads: 1.1-1.3x
  an fp32 product's time, where torch's int8/int4 kernels took 2.2-2.5x).

Answers change slightly: ``benchmarks/speed.py`` reports the KL divergence of each format's
next-token distributions to the fp32 model's.
"""

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from semanticache_rag import huge_pages
from semanticache_rag.errors import ConfigError
from semanticache_rag.gguf_codes import GROUP, auto_weights, group_codes, int8_codes, is_q8_0
from semanticache_rag.kernels import cpu_ops, int4_weights_ref

WEIGHTS = ("auto", "model", "fp32", "fp16", "bf16", "int8", "int4", "int4-exact")
COMPUTE_DTYPE = torch.bfloat16
#: rows from which an int8/int4 layer multiplies by its weights decoded to fp32 instead of by its codes
#: (measured, 2 threads, with torch's int8/int4 kernels: those won up to 32 rows, the decoded weights from 64
#: on, by 1.8-2x at 512). The int4 codes' product of kernels/int4_weights_cpu.cpp still wins at 128 rows
#: (576 x 3072: 3.65 vs 4.65 ms); 64 keeps reading, whose chunks are longer, on the model's exact weights.
MANY_ROWS = 64
_NEVER = 2**62  # a ``many_rows`` no product reaches


def check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise ConfigError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "fp16" and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise ConfigError(
            "weights='fp16' uses torch's fbgemm kernels, which this torch build lacks (they exist on x86 CPUs); "
            "use weights='int8' or 'bf16' instead"
        )


class _WeightOnlyLinear(nn.Module):
    """A linear layer whose product runs in bf16 from low-precision weights; input and output keep their dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.compute_dtype = COMPUTE_DTYPE  # attributes, not module globals: TorchScript (scripted_step) reads them
        self.many_rows = _NEVER  # from how many rows to multiply by the decoded() weights (never, unless set)
        self.one_row = False  # whether one row goes through row_product() (the C++ kernel) instead of product()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decoded(self) -> torch.Tensor:
        """The weights (out, in) in fp32, as :meth:`product` multiplies by them (formats that set ``many_rows``)."""
        raise NotImplementedError

    def row_product(self, x: torch.Tensor) -> torch.Tensor:
        """One fp32 row (in,) times the weights, (out,) fp32 (formats that set ``one_row``)."""
        raise NotImplementedError

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for ``x`` (rows, in), in ``x``'s dtype (the lean decoding step calls it directly)."""
        if x.shape[0] == 1 and self.one_row:
            out = self.row_product(x[0].float().contiguous())[None].to(x.dtype)
        elif x.shape[0] >= self.many_rows:
            out = F.linear(x.float(), self.decoded()).to(x.dtype)
        else:
            out = self.product(x.to(self.compute_dtype)).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(x.reshape(-1, self.in_features)).reshape(list(x.shape[:-1]) + [self.out_features])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Fp32Linear(_WeightOnlyLinear):
    """An fp32 model's weights as loaded (``weights="fp32"``), multiplied in fp32: many rows by torch's product,
    one row (a decoding step) by ``fp32_row_product`` (``kernels/fp32_weights_cpu.cpp``), which the C++ step
    calls too. The model's arithmetic up to the order of the sums."""

    weight: torch.Tensor
    fp32_rows = True  # as ExactInt4Linear: the rows multiplied as they are, so coded keys meet the query as it is

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        if linear.weight.dtype != torch.float32:
            raise ConfigError(f"weights='fp32' takes fp32 weights, got {linear.weight.dtype}")
        self._keep(linear)
        self.compute_dtype = torch.float32
        self.one_row = cpu_ops.available()  # one row by the C++ product (else torch's)

    def _keep(self, linear: nn.Linear) -> None:
        # a buffer: packed into huge pages with what else a decoding step streams (convert_weights)
        self.register_buffer("weight", linear.weight.detach().contiguous())

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def row_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.semanticache.fp32_row_product(x, self.weight)


class TiedFp32Linear(Fp32Linear):
    """:class:`Fp32Linear` for an output head tied to the input embedding: the embedding's own parameter, one
    tensor for both (a buffer would keep a second copy once the parameters are copied out of the loader's map)."""

    def _keep(self, linear: nn.Linear) -> None:
        self.weight = linear.weight


class BF16Linear(_WeightOnlyLinear):
    weight: torch.Tensor

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self.register_buffer("weight", linear.weight.detach().to(COMPUTE_DTYPE))

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FP16Linear(_WeightOnlyLinear):
    """fp16 weights packed for fbgemm's fp32-by-fp16 product; inputs, sums and outputs in fp32."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        # the bias is added by the packed product itself
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), self.bias)
        self.packed_nbytes = 2 * self.in_features * self.out_features  # not a buffer: fbgemm's own object

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)


class Int8Linear(_WeightOnlyLinear):
    """Symmetric int8 weights with one scale per output row."""

    codes: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        codes, scales = int8_codes(linear.weight, linear.in_features)
        self.register_buffer("codes", codes.flatten(1))
        self.register_buffer("scales", scales[:, 0].to(COMPUTE_DTYPE))
        self.many_rows = MANY_ROWS
        self.one_row = cpu_ops.available()  # one row in fp32 by kernels/q8_0_weights_cpu.cpp (else torch's kernel)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scales)

    def decoded(self) -> torch.Tensor:
        return torch.mul(self.codes, self.scales.float()[:, None])  # int8 x fp32: one fp32 tensor, no copy of the codes

    def row_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.semanticache.int8_row_product(x, self.codes, self.scales)


class Int4Linear(_WeightOnlyLinear):
    """4-bit codes in groups of :data:`GROUP` inputs, each group with a scale and a minimum (GGUF's Q4_1).

    The scales and minimums are kept in fp16, as the GGUF keeps them, so the default model's weights
    (dequantised from its Q4_1 file) decode exactly. Few rows (decoding, a question) go through the
    C++ product (``q4_1_product`` in ``kernels/int4_weights_cpu.cpp``), llama.cpp's arithmetic: each
    row quantised to Q8_0 and the code products summed as integers (AVX-512 VNNI, 128 weights an
    instruction pair), each block of codes loaded once for all rows. That changes the arithmetic (the
    rows lose their int8 rounding; the speed benchmark reports the answers' KL). Many rows (reading)
    multiply in fp32 by the decoded weights, the model's own. Without the C++ kernels the layer keeps
    its decoded weights and every product is fp32's (exact; fp32's memory and speed, not int4's).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    dense: torch.Tensor
    fp32_rows = False  # ExactInt4Linear: rows multiplied as they are, in fp32

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        codes, scale, low = group_codes(linear.weight.detach())  # (out, in), (out, in / GROUP) twice
        self.register_buffer("codes", int4_weights_ref.q4_1_layout(codes))  # (out / 16, in / 8, 16, 4)
        for name, values in (("scales", scale), ("minimums", low)):  # (out / 16, in / GROUP, 16) fp16
            self.register_buffer(name, values.half().view(-1, 16, values.shape[1]).transpose(1, 2).contiguous())
        kernels = cpu_ops.available()  # builds the C++ kernels (once)
        self.compute_dtype = torch.float32  # rows are quantised from fp32, not from bf16
        self.many_rows = MANY_ROWS if kernels else 1
        self.one_row = kernels
        # without the kernels, the decoded weights are kept (fp32's memory and speed: the torch twin of the
        # product would decode them at every step, ~0.7 s a token for the default model)
        dense = torch.empty(0) if kernels else int4_weights_ref.unpack_q4_1(self.codes, self.scales, self.minimums).t()
        self.register_buffer("dense", dense.contiguous(), persistent=False)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.semanticache.q4_1_product(x.contiguous(), self.codes, self.scales, self.minimums)

    def decoded(self) -> torch.Tensor:
        if self.dense.numel() > 0:
            return self.dense
        return torch.ops.semanticache.unpack_q4_1(self.codes, self.scales, self.minimums).t()

    def row_product(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x[None])[0]


class ExactInt4Linear(Int4Linear):
    """:class:`Int4Linear` whose products keep the rows in fp32 (``weights="int4-exact"``).

    The weights are the decoded Q4_1 values exactly and every sum is in fp32
    (``q4_1_product_fp32``: per group, scale * the sum of input * code + minimum * the sum of the
    inputs), so the answers are the fp32 model's up to the order of the sums, at int4's memory. Slower
    than :class:`Int4Linear`'s integer sums where the codes would be read faster than converted.
    """

    fp32_rows = True

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.semanticache.q4_1_product_fp32(x.contiguous(), self.codes, self.scales, self.minimums)


class GroupedInt8Linear(_WeightOnlyLinear):
    """Symmetric int8 weights with one scale per group of :data:`GROUP` inputs of a row (GGUF's Q8_0).

    The product is llama.cpp's: each input row is quantised to Q8_0 too (per group of 32, scale =
    largest magnitude / 127), so every group's sum is of integers, which AVX-512 VNNI takes 64 code
    bytes at a time (``q8_0_product`` in ``kernels/q8_0_weights_cpu.cpp``; AVX2 in two steps). That
    changes the arithmetic (the inputs lose what their int8 rounding loses; the speed benchmark reports
    the answers' KL): the default model's decoding head took 1.8-2.1 ms a token on a 2-core AVX-512 CPU,
    against 3.1-3.8 through torch's int4 kernel on two 4-bit planes of each code. The codes are exact;
    the scales are rounded to bf16. For the default model's output head, a Q8_0 table in the GGUF, the codes
    found (:func:`~semanticache_rag.gguf_codes.int8_codes`) are the file's own. Rows go one at a time (the
    layer is a decoding head: one row a step).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    scale_dtype = COMPUTE_DTYPE  # ExactGroupedInt8Linear: fp32, so that fp16 scales stay exact

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        if linear.out_features % 16 or linear.in_features % GROUP:
            raise ValueError(
                f"a Q8_0 layer takes outputs in 16s and inputs in {GROUP}s, got {tuple(linear.weight.shape)}"
            )
        codes, scales = int8_codes(linear.weight, GROUP)  # (out, in / GROUP, GROUP), (out, in / GROUP)
        shifted = (codes.to(torch.int16) + 128).to(torch.uint8).view(-1, 16, self.in_features // 4, 4)
        self.register_buffer("codes", shifted.transpose(1, 2).contiguous())  # (out / 16, in / 4, 16, 4)
        grouped = scales.to(self.scale_dtype).view(-1, 16, scales.shape[1])
        self.register_buffer("scales", grouped.transpose(1, 2).contiguous())  # (out / 16, in / GROUP, 16)
        cpu_ops.available()  # builds the C++ kernels (once); without them the torch twin multiplies
        self.one_row = True
        self.compute_dtype = torch.float32  # rows are quantised from fp32, not from bf16

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.semanticache.q8_0_product(x.float().contiguous(), self.codes, self.scales)

    def row_product(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x[None])[0]


class ExactGroupedInt8Linear(GroupedInt8Linear):
    """:class:`GroupedInt8Linear`'s codes with fp32 scales, the rows kept in fp32 (``weights="int4-exact"``'s
    head, where the weights are Q8_0 values exactly: :func:`is_q8_0`).

    The weights are then the codes times their scales exactly, and every sum is in fp32
    (``q8_0_product_fp32``: per group, scale * the sum of input * code), so the logits are the fp32 head's
    up to the order of the sums, from a quarter of its bytes (the default model's: 31 MB for 113).
    """

    scale_dtype = torch.float32

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.semanticache.q8_0_product_fp32(x.float().contiguous(), self.codes, self.scales)


_LAYER_KINDS = {
    "fp32": Fp32Linear,
    "fp16": FP16Linear,
    "bf16": BF16Linear,
    "int8": Int8Linear,
    "int4": Int4Linear,
    "int4-exact": ExactInt4Linear,
}
# int4-exact: a head that is not a tied Q8_0 table stays as loaded (its fp32 arithmetic)
_HEAD_KINDS = {
    "fp32": Fp32Linear,
    "fp16": FP16Linear,
    "bf16": BF16Linear,
    "int8": Int8Linear,
    "int4": BF16Linear,
    "int4-exact": None,
}


def _fits(weights: str, linear: nn.Linear) -> bool:
    """Whether ``linear`` can take the ``weights`` format: int4 and Q8_0 work in groups of :data:`GROUP`
    inputs and blocks of 16 outputs."""
    return not weights.startswith("int4") or (linear.in_features % GROUP == 0 and linear.out_features % 16 == 0)


def _tied_head(model, head) -> bool:
    """Whether ``head`` multiplies by the input embedding table itself (which stays as loaded)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return embedding is not None and getattr(head, "weight", None) is embedding.weight


def convert_weights(model: Any, weights: str) -> Any:
    """Swap ``model``'s linear layers for ``weights``-format ones, in place; return the model.

    ``"model"`` leaves it as it is; ``"auto"`` is ``"int4-exact"`` where that is the model's own arithmetic
    on its own weights (:func:`~semanticache_rag.gguf_codes.auto_weights`: the default model), else ``"model"``.
    The input embedding keeps its dtype (a lookup reads one row per
    token), and so does any linear layer the int4 layout cannot take (an input size that is not a
    multiple of the group, an output size that is not a multiple of 16).
    The format is recorded as ``model.semanticache_weights`` (part of a stored cache's key). A
    Llama model also gets fused query/key/value and gate/up products and a lean forward pass for
    the engine (:mod:`.fused`), ``model.semanticache_forward``.

    Raises
    ------
    ConfigError
        For an unknown format, a model not on the CPU (these kernels are torch's CPU ones; on a GPU
        load the model in bf16 instead), or a model converted before.
    """
    check_weights(weights)
    done = getattr(model, "semanticache_weights", "model")
    from semanticache_rag import fused

    decoder = [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)] if fused.supports(model) else []
    if weights == "auto":
        weights = "model" if done != "model" else auto_weights(model, decoder, cpu_ops.available)
    if weights == "model":
        return model
    if done != "model":
        raise ConfigError(f"the model's weights are already {done!r}; load it again to use {weights!r}")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ConfigError(
            f"weights={weights!r} runs on CPUs; on {device.type} load the model with dtype=torch.bfloat16"
        )
    dtypes = {m.weight.dtype for m in model.modules() if isinstance(m, nn.Linear)} if weights == "fp32" else set()
    if dtypes - {torch.float32}:
        raise ConfigError(
            f"weights='fp32' keeps an fp32 model's weights; this one's are {sorted(map(str, dtypes))}: load the "
            "model with dtype=torch.float32, or use weights='bf16'"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_kind = _head_kind(model, head, weights)
    if decoder and all(_fits(weights, linear) for linear in decoder):
        fused.fuse_projections(model, _LAYER_KINDS[weights])
        model.semanticache_forward = fused.FusedLlama(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or not _fits(weights, child) or (child is head and head_kind is None):
                continue
            converted = (head_kind if child is head and head_kind is not None else _LAYER_KINDS[weights])(child)
            if child is head:  # an untied head reads 64 positions at a time: never decode its vocabulary for them
                converted.many_rows = _NEVER
            setattr(parent, name, converted)
    _own_parameters(model)
    # what a decoding step streams, in blocks of huge pages (semanticache_rag.huge_pages); the decoded
    # weights that reading multiplies by (``dense``) are read a chunk at a time and stay where they are
    huge_pages.pack_buffers((m for m in model.modules() if isinstance(m, _WeightOnlyLinear)), frozenset({"dense"}))
    huge_pages.release_freed_memory()
    model.semanticache_weights = weights
    return model


def _head_kind(model: Any, head: Any, weights: str) -> type[_WeightOnlyLinear] | None:
    """What the output ``head`` becomes with ``weights`` (``None``: it stays as loaded). A head tied to the input
    embedding gets one of its own for decoding where it can, and reading then multiplies by the embedding table
    (``model.semanticache_reading_head``)."""
    head_kind: type[_WeightOnlyLinear] | None = _HEAD_KINDS[weights]
    tied = head is not None and _tied_head(model, head)
    if weights == "fp32":  # a tied head stays the embedding's own parameter (no reading head of its own)
        return TiedFp32Linear if tied else head_kind
    if weights.startswith("int4") and tied and not cpu_ops.available():
        return None  # Q8_0's product is C++: without it the head stays the tied embedding table, as loaded
    if (
        tied
        and _fits(weights, head)
        and (weights in ("fp16", "int8", "int4") or (weights == "int4-exact" and is_q8_0(head.weight)))
    ):
        # a head of its own for decoding (int4: GGUF's Q8_0, fewer bytes and the default model's own codes;
        # int4-exact: the same codes in fp32 arithmetic, where they are the weights exactly); reading, which
        # needs the logits of many positions (surprisal), multiplies by the tied embedding table
        head_kind = {
            "fp16": FP16Linear,
            "int8": Int8Linear,
            "int4": GroupedInt8Linear,
            "int4-exact": ExactGroupedInt8Linear,
        }[weights]
        model.semanticache_reading_head = model.get_input_embeddings()
    return head_kind


def _own_parameters(model: nn.Module) -> None:
    """Copy the parameters left as loaded (embedding, norms) out of the loader's memory map.

    transformers maps the weights file; converting reads every page of it, and the mapping stays
    resident while any tensor still points into it, so the converted model would keep the whole
    file in its RSS (513 MiB for the default model) besides its own copies. A parameter shared by
    several modules (a tied head left as loaded) stays shared.
    """
    copies: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for module in model.modules():
            for name, parameter in list(module.named_parameters(recurse=False)):
                if id(parameter) not in copies:
                    copies[id(parameter)] = nn.Parameter(parameter.detach().clone(), requires_grad=False)
                setattr(module, name, copies[id(parameter)])
