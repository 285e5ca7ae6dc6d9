"""Quantized base weights as bitsandbytes stores and runs them, on fake tensors.

bitsandbytes' layers cannot be built on fake tensors (their weights are quantized from real
values when they move to a device), so a causal LM planned with ``--quantize`` gets stand-ins:
:class:`FakeLinear4bit` and :class:`FakeLinear8bitLt`. Each subclasses bitsandbytes' own class
(so PEFT wraps it in its own ``lora.bnb.Linear4bit`` / ``Linear8bitLt``, whose forward is the
one profiled), holds fake storage of exactly the quantized bytes, and runs the memory behaviour
of bitsandbytes' training kernels (read from bitsandbytes 0.50.2):

Storage (:func:`nf4_storage_bytes`, :func:`int8_storage_bytes`), for a weight of ``N x K``
(``n = N K`` values, ``nb = ceil(n / blocksize)`` blocks):

* nf4 (``functional.quantize_4bit``): two 4-bit codes per byte, ``ceil(n / 2)`` bytes of uint8
  (``Params4bit``, shape ``(ceil(n/2), 1)``); the 16 nf4 values, fp32 (``get_4bit_type``, 64
  bytes a layer); without double quantization an fp32 absmax per block, ``4 nb``; with it
  (``compress_statistics=True``) the absmax minus their mean in 8 bits, ``nb`` bytes
  (``quantize_blockwise(..., blocksize=256)``), the mean (fp32, 4 bytes), a second-level fp32
  absmax per 256 blocks, ``4 ceil(nb / 256)``, and that level's 256-value fp32 code map copied
  per layer (``code.to(device, copy=True)``, 1,024 bytes).
* int8 (``Int8Params._quantize``, ``int8_vectorwise_quant``): int8 weights, ``n`` bytes, and an
  fp32 scale per output row, ``4 N``.

Kernels modelled (what a training step allocates besides the stored weight):

* nf4, forward (``MatMul4Bit.forward`` -> ``gemm_4bit``): with double quantization the block
  absmax are dequantized to fp32 and the mean added (two ``nb``-float arrays, one at a time
  after the add), then the weight is dequantized to the compute dtype (``N x K``, transient)
  for ``F.linear``. This is the CPU kernel (``backends/default/ops.py``) and CUDA's for more
  than 1,536 rows (``backends/cuda/ops.py:_dequant_linear_fallback``): a step's ``B x T``
  tokens above that on every GPU architecture. CUDA's fused ``cgemm_4bit`` for fewer rows
  (chosen per architecture) allocates no dequantized weight: not modelled, the fallback bounds
  it from above by one transient ``N x K`` weight.
* nf4, backward (``MatMul4Bit.backward``): the input's gradient only (the weight is frozen):
  the absmax dequantized again (in place with the mean), the weight dequantized to its stored
  dtype and cast to the gradient's, ``grad @ W``. Saved for backward: nothing but the
  quantized weight, held as a ``ctx`` attribute and resident anyway; the input is not kept.
  A layer whose input takes no gradient (the first block's projections) runs the same forward
  without an autograd node.
* int8 on CUDA (``MatMul8bitLt``, ``threshold=0``): the input cast to fp16 and quantized
  row-wise (int8 ``M x K`` + fp32 ``M``), an int32 ``M x N`` product, dequantized to fp16 and
  cast to the input's dtype; the input is kept as a ``ctx`` attribute (alive until backward,
  unseen by saved-tensor hooks); backward dequantizes the weight to the input's dtype. With
  transformers' default ``llm_int8_threshold=6.0`` outlier columns are found from the values
  (``|A| >= 6`` and the columns' sub-matrix): data-dependent, not modelled.
* int8 on the CPU (``MatMul8bitFp``): the weight dequantized to the input's dtype for
  ``F.linear`` in forward and again in backward; the input kept as a ``ctx`` attribute.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from superneurons.errors import ConfigError

__all__ = [
    "FakeLinear4bit",
    "FakeLinear8bitLt",
    "int8_storage_bytes",
    "nf4_storage_bytes",
    "quantized_linear",
]

NF4_CODE_VALUES = 16  # get_4bit_type("nf4"): 16 fp32 values
DYNAMIC_CODE_VALUES = 256  # create_dynamic_map(): the second level's code, 256 fp32 values
SECOND_LEVEL_BLOCKSIZE = 256  # quantize_4bit's nested quantize_blockwise(..., blocksize=256)
FP32_BYTES = 4


def nf4_storage_bytes(
    out_features: int, in_features: int, *, double_quant: bool = True, blocksize: int = 64
) -> int:
    """Bytes bitsandbytes holds for an nf4 ``Linear4bit`` weight of ``out x in`` (module
    docstring's formula; bias not included)."""
    n = out_features * in_features
    blocks = math.ceil(n / blocksize)
    stored = math.ceil(n / 2) + FP32_BYTES * NF4_CODE_VALUES
    if not double_quant:
        return stored + FP32_BYTES * blocks
    second = math.ceil(blocks / SECOND_LEVEL_BLOCKSIZE)
    return stored + blocks + FP32_BYTES * (1 + second + DYNAMIC_CODE_VALUES)


def int8_storage_bytes(out_features: int, in_features: int) -> int:
    """Bytes bitsandbytes holds for a ``Linear8bitLt`` weight (``has_fp16_weights=False``):
    int8 values and an fp32 scale per output row (bias not included)."""
    return out_features * in_features + FP32_BYTES * out_features


def _bnb() -> Any:
    try:
        import bitsandbytes
    except ImportError as exc:  # an optional dependency
        raise ConfigError(
            "--quantize models bitsandbytes' layers: pip install bitsandbytes (no GPU needed)"
        ) from exc
    return bitsandbytes


def _frozen(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    # NOTE: the quantization state is held as frozen parameters (bitsandbytes keeps it on a
    # QuantState), so the profile counts it as resident and as frozen
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def quantized_linear(
    linear: nn.Linear, kind: str, *, double_quant: bool, blocksize: int, compute: torch.dtype,
    target_device: str,
) -> nn.Module:  # fmt: skip
    """The stand-in for ``linear`` quantized as ``kind`` (``nf4`` or ``int8``), built in the
    caller's ``FakeTensorMode``: an instance of a subclass of :class:`FakeLinear4bit` (or
    :class:`FakeLinear8bitLt`) and of bitsandbytes' own class. ``compute``: the dtype its
    matmuls run in (``Linear4bit``'s ``compute_dtype``); ``target_device``: whose kernels are
    modelled.

    Raises:
        ConfigError: bitsandbytes is not installed.
    """
    bnb = _bnb()
    behaviour, base = (
        (FakeLinear4bit, bnb.nn.Linear4bit)
        if kind == "nf4"
        else (FakeLinear8bitLt, bnb.nn.Linear8bitLt)
    )
    cls: Any = _standin(behaviour, base)
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)  # bitsandbytes' __init__ would quantize real values
    layer.in_features, layer.out_features = linear.in_features, linear.out_features
    layer.stored_dtype = linear.weight.dtype  # the dtype the weight had when it was quantized
    layer.cuda_kernels = target_device == "cuda"
    layer.bias = (
        None if linear.bias is None else _frozen((linear.out_features,), linear.weight.dtype)
    )
    if kind == "nf4":
        return layer.quantize_nf4(double_quant=double_quant, blocksize=blocksize, compute=compute)
    return layer.quantize_int8()


@functools.cache
def _standin(behaviour: type, base: type) -> type:
    """``behaviour`` first (its ``forward``), then bitsandbytes' class: PEFT's dispatch checks
    ``isinstance(layer, bnb.nn.Linear4bit)`` and wraps it in ``lora.bnb.Linear4bit``."""
    return type(behaviour.__name__, (behaviour, base), {"__module__": __name__})


class FakeLinear4bit(nn.Linear):
    """An nf4 ``bitsandbytes.nn.Linear4bit`` (a subclass of it at run time) on fake tensors:
    the stored bytes as frozen parameters and ``MatMul4Bit``'s allocations (module
    docstring). Built by :func:`quantized_linear`."""

    in_features: int
    out_features: int
    stored_dtype: torch.dtype
    cuda_kernels: bool

    def quantize_nf4(
        self, *, double_quant: bool, blocksize: int, compute: torch.dtype
    ) -> FakeLinear4bit:
        n = self.out_features * self.in_features
        blocks = math.ceil(n / blocksize)
        self.weight = _frozen((math.ceil(n / 2), 1), torch.uint8)  # Params4bit's packed codes
        # what PEFT's dispatch reads from a Params4bit (peft/tuners/lora/bnb.py)
        self.weight.compress_statistics = double_quant  # type: ignore[attr-defined]
        self.weight.quant_type = "nf4"  # type: ignore[attr-defined]
        self.code = _frozen((NF4_CODE_VALUES,), torch.float32)
        if double_quant:
            second = math.ceil(blocks / SECOND_LEVEL_BLOCKSIZE)
            self.absmax = _frozen((blocks,), torch.uint8)
            self.offset = _frozen((), torch.float32)
            self.absmax2 = _frozen((second,), torch.float32)
            self.code2 = _frozen((DYNAMIC_CODE_VALUES,), torch.float32)
        else:
            self.absmax = _frozen((blocks,), torch.float32)
        self.double_quant, self.blocksize, self.blocks = double_quant, blocksize, blocks
        self.compute_dtype = compute
        self.compute_type_is_set = True
        self.quant_state = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or (bias is not None and bias.requires_grad)
        )
        if needs_grad:
            out = _MatMul4Bit.apply(x, self.weight, bias, self)
        else:
            out = _gemm_4bit(x, self, bias)
        return out.to(inp_dtype)

    def dequantized_absmax(self, *, in_place: bool) -> list[torch.Tensor]:
        """The block absmax in fp32 as bitsandbytes rebuilds them (double quantization only):
        ``dequantize_blockwise``, then the mean added in place (``functional.dequantize_4bit``,
        backward) or into a new array (``gemm_4bit``, forward); CUDA's forward keeps the first
        array as well until it returns (``_dequant_linear_fallback``'s ``absmax_dq``)."""
        if not self.double_quant:
            return []
        absmax = torch.empty(self.blocks, dtype=torch.float32)  # (nb,)
        if in_place:
            return [absmax.add_(self.offset)]
        added = absmax + self.offset
        return [absmax, added] if self.cuda_kernels else [added]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(self.out_features, self.in_features, dtype=dtype)  # (N, K)


def _gemm_4bit(x: torch.Tensor, layer: FakeLinear4bit, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.ops.bitsandbytes.gemm_4bit``: dequantize, then ``F.linear``."""
    absmax = layer.dequantized_absmax(in_place=False)  # alive until the op returns
    weight = layer.dequantized(x.dtype)
    out = nn.functional.linear(x, weight, bias)
    del absmax, weight
    return out


class _MatMul4Bit(torch.autograd.Function):
    """``bitsandbytes.autograd._functions.MatMul4Bit``'s memory: nothing saved but the
    quantized weight (a ctx attribute), the weight dequantized again for the input's
    gradient."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, _weight: torch.Tensor, bias: Any, layer: FakeLinear4bit
    ) -> torch.Tensor:
        ctx.layer = layer
        ctx.has_bias = bias is not None
        return _gemm_4bit(x, layer, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        layer: FakeLinear4bit = ctx.layer
        grad_x = None
        if ctx.needs_input_grad[0]:
            absmax = layer.dequantized_absmax(in_place=True)
            weight = layer.dequantized(layer.stored_dtype).to(grad.dtype)
            del absmax
            grad_x = torch.matmul(grad, weight)  # (..., N) @ (N, K)
        grad_bias = grad.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


class FakeLinear8bitLt(nn.Linear):
    """A ``bitsandbytes.nn.Linear8bitLt`` (int8 weights, ``has_fp16_weights=False``; a
    subclass of it at run time) on fake tensors: int8 weights and per-row fp32 scales as
    frozen parameters, and ``MatMul8bitLt``'s (CUDA) or ``MatMul8bitFp``'s (CPU) allocations
    (module docstring). Built by :func:`quantized_linear`."""

    in_features: int
    out_features: int
    stored_dtype: torch.dtype
    cuda_kernels: bool

    def quantize_int8(self) -> FakeLinear8bitLt:
        self.weight = _frozen((self.out_features, self.in_features), torch.int8)  # CB
        self.weight.has_fp16_weights = False  # type: ignore[attr-defined]
        self.scales = _frozen((self.out_features,), torch.float32)  # SCB
        # what PEFT's dispatch reads (peft/tuners/lora/bnb.py): threshold 0, no outliers
        self.state = _bnb().MatmulLtState()
        self.state.has_fp16_weights, self.state.threshold = False, 0.0
        self.index = None
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        bias: torch.Tensor | None = self.bias
        if bias is not None and bias.dtype != x.dtype:  # bitsandbytes casts it in place
            bias = bias.to(x.dtype)
        fn = _MatMul8bitLt if self.cuda_kernels else _MatMul8bitFp
        return fn.apply(x, self.weight, bias, self)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``CB.to(dtype, copy=True).mul_(SCB.unsqueeze(1).mul(1 / 127))``."""
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype)  # (N, K)
        return weight.mul_(self.scales.unsqueeze(1).mul(1.0 / 127.0))


class _MatMul8bitLt(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, _weight: torch.Tensor, bias: Any, layer: FakeLinear8bitLt
    ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (M, K), a view
        half = rows.to(torch.float16)  # int8_vectorwise_quant's input
        quantized = torch.empty(rows.shape, dtype=torch.int8)  # CA, alive until forward returns
        row_stats = torch.empty(rows.shape[0], dtype=torch.float32)  # SCA
        del half
        product = torch.empty(rows.shape[0], layer.out_features, dtype=torch.int32)
        out16 = torch.empty(product.shape, dtype=torch.float16)  # int8_mm_dequant's output
        if bias is not None:
            out16.add_(bias)
        out = out16.to(x.dtype)
        del product, out16, quantized, row_stats
        ctx.layer, ctx.input, ctx.shape = layer, rows, x.shape  # MatMul8bitLt's ctx.tensors
        return out.reshape(*x.shape[:-1], layer.out_features)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _int8_backward(ctx, grad)


class _MatMul8bitFp(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, _weight: torch.Tensor, bias: Any, layer: FakeLinear8bitLt
    ) -> torch.Tensor:
        weight = layer.dequantized(x.dtype)
        ctx.layer, ctx.input, ctx.shape = layer, x, x.shape  # MatMul8bitFp's ctx.A
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        return _int8_backward(ctx, grad)


def _int8_backward(ctx: Any, grad: torch.Tensor) -> Any:
    """Both int8 kernels' backward: the bias' gradient, then the input's through the weight
    dequantized to the input's dtype."""
    grad_bias = grad.sum(0) if ctx.needs_input_grad[2] else None
    grad_x = None
    if ctx.needs_input_grad[0]:
        rows = grad.reshape(-1, grad.shape[-1])  # (M, N)
        weight = ctx.layer.dequantized(ctx.input.dtype)
        grad_x = torch.matmul(rows.to(ctx.input.dtype), weight).view(ctx.shape)
    return grad_x, None, grad_bias, None
