"""A lean forward pass for Llama-family models with weight-only matrices (:mod:`.weights`).

With int4 weights a decoding step of the default model spends less time in its matrix products
than in the few thousand small tensor operations around them. This forward pass does what
``LlamaForCausalLM.forward`` does, with one product for the query, key and value projections and
one for the gate and up projections (fused when the weights are converted), one cast to the
product dtype per product, RoPE from the model's own inverse frequencies, and the same attention
function and cache (:func:`~semanticache_rag.attention.semanticache_attention`, hooks included).
The model's ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` become row slices of the
fused products (:class:`RowSlice`), so transformers' own forward (``model.generate``) still works,
at the price of computing the fused product once per slice.

A decoding step (one new token) takes a leaner path still (:meth:`FusedLlama.step`): fused RMS norms,
the weight products called directly, RoPE as one gather and one multiply-add, and attention for the
single query written as four batched products over the document and the appended tokens, with the
document's ``log s`` bias computed once per conversation. The arithmetic is the same as the general
path's up to the rounding of fused operations (``tests/test_weights.py`` holds them within 1e-5),
in two thirds of the tensor operations (1,600 instead of 2,500 per step on the default model).

It applies to ``LlamaForCausalLM`` with RoPE that does not depend on the sequence length; other
models keep transformers' forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from semanticache_rag import coded_attention, scripted_step
from semanticache_rag.attention import semanticache_attention

_STATIC_ROPE = ("default", "linear", "llama3")
# positions whose RoPE rotation a one-token step's table holds (FusedLlama._rotation): 128 KiB of fp32;
# tables kept, so that conversations whose steps interleave (a server's) do not remake them each step
ROTATION_BLOCK = 256
ROTATION_TABLES = 8


class RowSlice(nn.Module):
    """Rows ``start:stop`` of a fused linear layer's output (what the replaced projection returned)."""

    def __init__(self, fused: nn.Module, start: int, stop: int):
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.stop]


def _concatenated(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose output is the outputs of ``linears`` side by side."""
    biases = [lin.bias for lin in linears]
    fused = nn.Linear(linears[0].in_features, sum(lin.out_features for lin in linears), bias=biases[0] is not None)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([lin.weight for lin in linears]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat(biases))  # type: ignore[arg-type]
    return fused


def supports(model) -> bool:
    """Whether :class:`FusedLlama` can run ``model``."""
    config = model.config
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    return type(model).__name__ == "LlamaForCausalLM" and rope in _STATIC_ROPE and config.hidden_act == "silu"


def fuse_projections(model, kind) -> None:
    """Replace each layer's q/k/v and gate/up projections by one ``kind`` layer each (and row slices)."""
    for layer in model.model.layers:
        for owner, names, fused_name in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
            (layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj"),
        ):
            linears = [getattr(owner, n) for n in names]
            fused = kind(_concatenated(linears))
            setattr(owner, fused_name, fused)
            start = 0
            for name, linear in zip(names, linears):
                setattr(owner, name, RowSlice(fused, start, start + linear.out_features))
                start += linear.out_features


class FusedLlama:
    """``forward(kv, ids, start, logits_to_keep)`` of a Llama model whose projections were fused."""

    def __init__(self, model):
        self.model = model
        config = model.config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        rotary = model.model.rotary_emb
        self.inv_freq, self.rope_scale = rotary.inv_freq, rotary.attention_scaling
        half = self.head_dim // 2
        self._swap = torch.cat((torch.arange(half, self.head_dim), torch.arange(half)))  # x2 | x1
        self.dtype = model.model.embed_tokens.weight.dtype  # step() is written for fp32 models
        self._scripted: torch.jit.ScriptModule | None | bool = False  # scripted at the first step (scripted_step)
        self._kernel: bool | None = None  # whether steps attend through the C++ kernel; decided at the first step
        self._native: object = False  # the C++ step's weights (native_layers), made at the first step
        self._rotations: dict = {}  # (block, dtype) -> cos and signed sin of its positions, the newest last
        # the one-token step's RMS norms (kernels/rms_norm_cpu.cpp once built: torch's costs ~26 us a row)
        from semanticache_rag.kernels import cpu_ops

        cpu_ops.define()

    @staticmethod
    def _norm(module, x: torch.Tensor) -> torch.Tensor:
        # LlamaRMSNorm's arithmetic, in its order
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        return module.weight * h.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    def __call__(
        self, kv, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int = 1, head: bool = True
    ) -> torch.Tensor:
        """Logits of the last ``logits_to_keep`` positions (1, K, V); with ``head=False`` their final
        hidden states (1, K, hidden) instead."""
        if input_ids.shape[1] == 1 and kv.observe is None and self.dtype == torch.float32:
            return self.step(kv, input_ids, position_ids, head)
        return self.sequence(kv, input_ids, position_ids, logits_to_keep, head)

    def sequence(
        self, kv, input_ids: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int = 1, head: bool = True
    ) -> torch.Tensor:
        """:meth:`__call__` for any number of tokens (reading, a question), with an observer too."""
        core = self.model.model
        x = core.embed_tokens(input_ids)
        length = input_ids.shape[1]
        cos, sin = self._cos_sin(position_ids, x.dtype)
        cos, sin = cos[:, None], sin[:, None]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for index, layer in enumerate(core.layers):
            attention = layer.self_attn
            qkv = attention.qkv_proj(self._norm(layer.input_layernorm, x))
            # RoPE on the query and key heads at once (they are side by side in the fused product)
            qk = qkv[..., : q_size + kv_size].view(1, length, self.heads + self.kv_heads, self.head_dim)
            qk = self._rope(qk.transpose(1, 2), cos, sin)
            v = qkv[..., q_size + kv_size :].view(1, length, self.kv_heads, self.head_dim).transpose(1, 2)
            keys, values = kv.update(qk[:, self.heads :], v, index)
            out, _ = semanticache_attention(
                attention, qk[:, : self.heads], keys, values, None, scaling=attention.scaling, semanticache_kv=kv
            )
            x = x + attention.o_proj(out.reshape(1, length, q_size))
            mlp = layer.mlp
            gate, up = mlp.gate_up_proj(self._norm(layer.post_attention_layernorm, x)).chunk(2, dim=-1)
            x = x + mlp.down_proj(F.silu(gate) * up)
        x = self._norm(core.norm, x[:, -logits_to_keep:])
        return self.model.lm_head(x) if head else x

    def _cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's ``cos`` and ``sin`` at ``position_ids`` (1, T): (1, T, head_dim) each, in ``dtype``."""
        freqs = position_ids[..., None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * self.rope_scale).to(dtype), (angles.sin() * self.rope_scale).to(dtype)

    @staticmethod
    def _position(position_ids: torch.Tensor) -> int:
        """The one position of a decoding step's ``position_ids``."""
        if position_ids.numel() != 1:
            raise ValueError(f"a decoding step takes one position, got {position_ids.numel()}")
        return int(position_ids.reshape(-1)[0])

    def _rotation(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_rotation_at` the one position of ``position_ids``."""
        return self._rotation_at(self._position(position_ids), dtype)

    def _rotation_at(self, position: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and the signed ``sin`` of one position, so that RoPE is ``x * cos + x[..., swap] * sin``.

        Rows of a table of :data:`ROTATION_BLOCK` positions, made at once by the same operations (each value
        the one a single position gives, bit for bit: tested), so that a step makes none of them (its rows'
        views too are made with the table).
        """
        block, row = divmod(position, ROTATION_BLOCK)
        table = self._rotations.get((block, dtype))
        if table is None:
            first = block * ROTATION_BLOCK
            cos, sin = self._cos_sin(torch.arange(first, first + ROTATION_BLOCK)[None], dtype)
            half = sin.shape[-1] // 2
            sin[..., :half].neg_()  # rotate_half's minus sign, carried by sin
            table = (cos[0].unbind(0), sin[0].unbind(0))
            if len(self._rotations) >= ROTATION_TABLES:  # the oldest goes (conversations interleave steps)
                self._rotations.pop(next(iter(self._rotations)), None)
            self._rotations[(block, dtype)] = table
        return table[0][row], table[1][row]

    def step(self, kv, input_ids: torch.Tensor, position_ids: torch.Tensor, head: bool = True) -> torch.Tensor:
        """One decoding step: what :meth:`__call__` computes for a single new token, (1, 1, V) or (1, 1, hidden).

        With int4 or fp32 weights the whole step is one C++ call (:func:`native_layers`,
        ``kernels/decoder_step_cpu.cpp``: the embedding row, the layers, the final norm and a Q8_0 or fp32 head)
        where the kernels are built and the cache allows it; otherwise the layers are one TorchScript call
        (:mod:`.scripted_step`), or the Python loop below. All three compute the same operations in the
        same order (the C++ step's RoPE and residual adds to within a rounding; its final norm by the same
        ATen operations as :meth:`_norm`). Each Python operation left in a step cost 5-7x its cache-warm time
        there (the layers' weights have just streamed through the caches): the embedding, the final
        norm and RoPE's angles took 0.45 ms of a 7 ms step on a 2-core AVX2 CPU before they moved.
        """
        core = self.model.model
        out = self._native_step(kv, int(input_ids), self._position(position_ids), head)
        if out is not None:  # int4 or fp32 weights: the whole step in one C++ call
            return out
        cos, sin = self._rotation(position_ids, self.dtype)
        x = core.embed_tokens(input_ids).view(1, -1)
        scripted = self._script() if self._scripted_inputs(kv) else None
        if scripted is None:
            x = self._python_layers(kv, x, cos, sin)
        else:
            x = self._scripted_layers(scripted, kv, x, cos, sin)
        x = self._norm(core.norm, x.view(1, 1, -1))
        return self.model.lm_head(x) if head else x

    def token(self, kv, token: int, position: int, head: bool = True) -> torch.Tensor:
        """:meth:`__call__` for one token at one position, given as ints (a decoding step): where the step runs
        in one C++ call, no tensor is made for them (each Python operation left in a step costs ~5x its
        cache-warm time there, after the weights have streamed through the caches)."""
        if self._plain_step(kv):
            out = self._native_step(kv, token, position, head)
            if out is not None:
                return out
        device = self.model.model.embed_tokens.weight.device
        return self(kv, torch.tensor([[token]], device=device), torch.tensor([[position]], device=device), 1, head)

    def _plain_step(self, kv) -> bool:
        """Whether a decoding step on ``kv`` may skip the forward pass: no compressor observes its queries, and the
        model is fp32 (the C++ step's arithmetic)."""
        return kv.observe is None and self.dtype == torch.float32

    def _native_for(self, kv) -> tuple | None:
        """The C++ step's weights (:func:`native_layers`) and ``kv``'s document as it takes them, or ``None`` where
        it cannot take this model or cache."""
        native = self._native_layers() if self._scripted_inputs(kv) else None
        document = scripted_step.kept_step_document(kv) if native is not None else None
        return None if document is None else (native, document)

    def _native_step(self, kv, token: int, position: int, head: bool) -> torch.Tensor | None:
        """The step by the C++ step (:func:`native_layers`: the embedding row, the layers, the final norm
        and a Q8_0 or fp32 head in one call), or ``None`` (nothing done) where it cannot take this model or cache."""
        parts = self._native_for(kv)
        if parts is None:
            return None
        native, document = parts
        in_step = head and native.has_head()
        cos, sin = self._rotation_at(position, self.dtype)
        appended_keys, appended_values, length = kv.buffers(1)
        out = native.token_step(token, cos, sin, document, appended_keys, appended_values, length, in_step)
        kv.extend(1)  # its key and value written into kv's buffers
        out = out.view(1, 1, -1)
        return self.model.lm_head(out) if head and not in_step else out

    def greedy_tokens(self, kv, token: int, position: int, count: int, stops: Sequence[int] = ()) -> list[int] | None:
        """Up to ``count`` greedy decoding steps in one C++ call: the first runs ``token`` at ``position``, each
        later one the token the step before chose (its largest logit: ``argmax``), until one chooses a token of
        ``stops`` (never run). The tokens chosen, one a step run; ``None`` (nothing done) where the whole step with
        its head is not one C++ call."""
        parts = self._native_for(kv) if self._plain_step(kv) else None
        if parts is None or not parts[0].has_head():
            return None
        native, document = parts
        rows = [self._rotation_at(p, self.dtype) for p in range(position, position + count)]
        cos, sin = (torch.stack(side) for side in zip(*rows))
        appended_keys, appended_values, length = kv.buffers(count)
        chosen = native.greedy_steps(token, cos, sin, document, appended_keys, appended_values, length, list(stops))
        kv.extend(len(chosen))
        return chosen

    def kernel(self) -> bool:
        """Whether decoding steps attend through the C++ kernel (:mod:`~semanticache_rag.kernels.cpu_ops`):
        it is built (at the first call) and takes this model's heads."""
        if self._kernel is None:
            from semanticache_rag.kernels import cpu_ops

            group = self.heads // self.kv_heads
            self._kernel = cpu_ops.supports(self.head_dim, group) and cpu_ops.available()
        return self._kernel

    @contextlib.contextmanager
    def timed_steps(self):
        """Time the parts of the C++ steps run inside (for benchmarks): yields a dict that, at exit, holds the
        steps counted and per step the milliseconds of the whole C++ call (``step``), the attention of every
        layer, the rest of the layers (``products``: the weight products and the small row operations
        between them), the head, and the C++ call's own rest (``other``: the embedding row, checks, the final
        norm). Empty where steps do not run in C++ (weights other than int4 and fp32, no kernels)."""
        native = self._native_layers()
        timings: dict = {}
        if native is None:
            yield timings
            return
        native.set_timing(True)
        try:
            yield timings
        finally:
            steps, whole, region, attention, head = native.timings()
            native.set_timing(False)
            if steps:
                parts = {"step": whole, "attention": attention, "products": region - attention, "head": head}
                parts["other"] = whole - region - head
                timings.update({"steps": int(steps), **{k: round(1000 * v / steps, 3) for k, v in parts.items()}})

    def _native_layers(self):
        """The C++ step's weights (:func:`native_layers`), made at the first call; ``None`` where it cannot run."""
        if self._native is False:
            self._native = (
                native_layers(self.model, self.heads, self.kv_heads, self.head_dim) if self.kernel() else None
            )
        return self._native

    def _kernel_inputs(self, kv) -> tuple | None:
        """The scripted step's document inputs where the kernel attends them, else ``None``."""
        return scripted_step.kept_step_inputs(kv) if self.kernel() else None

    def _python_layers(self, kv, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The decoder layers for one token, ``x`` (1, hidden), one operation at a time."""
        core = self.model.model
        inputs = self._kernel_inputs(kv)
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        q_size, kv_size, group = heads * dim, kv_heads * dim, heads // kv_heads
        swap = self._swap
        for index, layer in enumerate(core.layers):
            attention, mlp = layer.self_attn, layer.mlp
            norm = layer.input_layernorm
            qkv = attention.qkv_proj.rows(torch.ops.semanticache.rms_norm(x, norm.weight, norm.variance_epsilon))
            qk = qkv[:, : q_size + kv_size].view(heads + kv_heads, dim)
            qk = torch.addcmul(qk * cos, qk.index_select(1, swap), sin)
            # (kv_heads, group, dim): query heads h = kv_head * group + g, as transformers' repeat_kv orders them
            query = qk[:heads].view(kv_heads, group, dim) * attention.scaling
            key = qk[heads:].view(1, kv_heads, 1, dim)
            value = qkv[:, q_size + kv_size :].view(1, kv_heads, 1, dim)
            keys, values = kv.layers[index].update(key, value)
            document = kv.layers[index].document
            if (
                inputs is not None and document is not None and "low_rank" not in (inputs[1][index], inputs[3][index])
            ):  # the scripted step's kernel call, as it makes it
                out = scripted_step.kernel_attention(
                    query, inputs[0][index], inputs[1][index], inputs[2][index], inputs[3][index], inputs[4][index],
                    keys[0], values[0], scripted_step.rounds_query(layer),
                )  # fmt: skip
            elif document is not None:  # coded layers are attended as stored (semanticache_rag.coded_attention)
                # without the C++ kernel the keys meet the query as it is, int4 weights included (the kernel
                # rounds it to Q8_0 there: scripted_step.rounds_query), so such answers differ beyond rounding
                scores = torch.bmm(query, keys[0].transpose(1, 2))
                doc_keys, doc_values = coded_attention.stored(document)
                doc_scores = coded_attention.scores(doc_keys, query, kv.scratch)
                bias = kv.log_sizes(index)
                if bias is not None:
                    doc_scores += bias[0, :, None]
                probs = torch.softmax(torch.cat([doc_scores, scores], dim=-1), dim=-1)
                num_doc = doc_scores.shape[-1]
                out = torch.bmm(probs[..., num_doc:], values[0])
                out = coded_attention.mix(doc_values, probs[..., :num_doc], out, kv.scratch)
            else:
                out = torch.bmm(torch.softmax(torch.bmm(query, keys[0].transpose(1, 2)), dim=-1), values[0])
            x = x + attention.o_proj.rows(out.view(1, q_size))
            norm = layer.post_attention_layernorm
            normed = torch.ops.semanticache.rms_norm(x, norm.weight, norm.variance_epsilon)
            gate, up = mlp.gate_up_proj.rows(normed).chunk(2, dim=-1)
            x = x + mlp.down_proj.rows(F.silu(gate) * up)
        return x

    def _scripted_inputs(self, kv) -> bool:
        """Whether ``kv`` can take the scripted step: document layers it attends
        (:func:`.scripted_step.step_inputs`, kept on ``kv``), every layer's appended buffer started and as
        long as the others."""
        lengths = {layer.length if layer.is_initialized else -1 for layer in kv.layers}
        return scripted_step.kept_step_inputs(kv) is not None and len(lengths) == 1 and min(lengths) >= 0

    def _script(self) -> torch.jit.ScriptModule | None:
        """The scripted layers, scripted at the first call (``None`` where TorchScript cannot take them)."""
        if self._scripted is False:
            self._scripted = scripted_step.script(self.model, self.heads, self.kv_heads, self.head_dim, self.kernel())
        return self._scripted  # type: ignore[return-value]

    def _scripted_layers(
        self, scripted: torch.jit.ScriptModule, kv, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`_python_layers` as one call of the ``scripted`` layers."""
        appended_keys, appended_values, length = kv.buffers(1)
        keys, key_kinds, values, value_kinds, biases, scratch = kv.step_inputs
        scratch_keys, scratch_values = (
            kv.scratch.buffer(name, torch.Size([scratch]), x.dtype, x.device) for name in ("keys", "values")
        )
        x = scripted(
            x, cos, sin, self._swap, keys, key_kinds, values, value_kinds, biases,
            appended_keys, appended_values, length, scratch_keys, scratch_values,
        )  # fmt: skip
        kv.extend(1)
        return x


def _product_tensors(product) -> list[torch.Tensor] | None:
    """What the C++ step takes of one of a layer's products: an :class:`~semanticache_rag.weights.Int4Linear`'s
    codes, scales and minimums, or an :class:`~semanticache_rag.weights.Fp32Linear`'s matrix and two empty
    tensors; ``None`` for any other product (or one with a bias)."""
    from semanticache_rag.weights import Fp32Linear, Int4Linear

    if getattr(product, "bias", None) is not None:
        return None
    if isinstance(product, Int4Linear) and not product.dense.numel():
        return [product.codes, product.scales, product.minimums]
    if isinstance(product, Fp32Linear) and product.one_row and product.weight.is_contiguous():
        return [product.weight.detach(), torch.empty(0), torch.empty(0)]
    return None


def _head_tensors(head) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The output head as the C++ step multiplies by it: a :class:`~semanticache_rag.weights.GroupedInt8Linear`'s
    Q8_0 codes and scales (either kind), or an :class:`~semanticache_rag.weights.Fp32Linear`'s matrix and no
    scales; ``None`` where the head is neither (the caller multiplies by it)."""
    from semanticache_rag.weights import Fp32Linear, GroupedInt8Linear

    if getattr(head, "bias", None) is not None or not getattr(head, "one_row", False):
        return None
    if isinstance(head, GroupedInt8Linear):
        return head.codes, head.scales
    if isinstance(head, Fp32Linear) and head.weight.is_contiguous():
        return head.weight.detach(), torch.empty(0)
    return None


def native_layers(model, heads: int, kv_heads: int, dim: int):
    """``torch.classes.semanticache.Int4Layers`` holding ``model``'s decoder layers (sharing their
    tensors) where every projection is an :class:`~semanticache_rag.weights.Int4Linear` on its codes or an
    :class:`~semanticache_rag.weights.Fp32Linear` (the C++ kernels built) and the norms are fp32; ``None``
    otherwise. It also holds the step's ends (``token_step``): the embedding table, the final norm and, where
    the output head is a :class:`~semanticache_rag.weights.GroupedInt8Linear` (Q8_0, either kind) or an
    :class:`~semanticache_rag.weights.Fp32Linear`, the head (:func:`_head_tensors`)."""
    from semanticache_rag.kernels import cpu_ops
    from semanticache_rag.weights import Fp32Linear, Int4Linear

    embedding = model.model.embed_tokens.weight
    if not cpu_ops.available() or model.model.norm.weight.dtype != torch.float32:
        return None
    if embedding.dtype != torch.float32 or not embedding.is_contiguous():  # the step copies its rows
        return None
    tensors, eps = [], []
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        products = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        parts = [_product_tensors(p) for p in products]
        if any(part is None for part in parts) or any(norm.weight.dtype != torch.float32 for norm in norms):
            return None
        for norm, pair in zip(norms, (parts[:2], parts[2:])):
            tensors.append(norm.weight.detach())
            for part in pair:
                tensors += part
            eps.append(float(norm.variance_epsilon))
    # the layer's order of tensors: norm, qkv, o, norm, gate/up, down (decoder_step_cpu.cpp)
    scaling = {float(layer.self_attn.scaling) for layer in model.model.layers}
    kinds = (Int4Linear, Fp32Linear)
    rows = {type(m).fp32_rows for layer in model.model.layers for m in layer.modules() if isinstance(m, kinds)}
    if len(scaling) != 1 or len(rows) != 1:
        return None
    native = torch.classes.semanticache.Int4Layers(tensors, eps, heads, kv_heads, dim, scaling.pop(), rows.pop())
    # the step's ends: the embedding row, the final norm, and a Q8_0 or fp32 head (its one-row product) in the call
    head = _head_tensors(model.lm_head) or (torch.empty(0), torch.empty(0))
    norm = model.model.norm
    native.set_ends(embedding.detach(), norm.weight.detach(), float(norm.variance_epsilon), *head)
    return native
