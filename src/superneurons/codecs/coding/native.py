"""The codecs' fused CPU kernels, built on first use and loaded by ctypes: the per-chunk
quantisers' (``rowquant.c``, :func:`kernels`), the range-float quantiser's
(``rangefloat.c``, :func:`rangefloat_kernels`, called from
:mod:`superneurons.codecs.coding.rangefloat`), the Elias-Fano index coder (``gapcode.c``,
:func:`gapcode_kernels`, called from :mod:`superneurons.codecs.coding.indexcode`) and the FFT
codec's per-block kernels (``spectrum.c``, :func:`spectrum_kernels`, called from
:mod:`superneurons.codecs.sparse.blocks`).

A chain of torch and numpy calls sweeps a block of values once per operation (multiply, add
and convert, pack, dequantise, subtract: about seven passes for a quantised block with its
residual). The kernels do the element-wise part in one pass, with the same IEEE operations in
the same order, so the bits are the same (``tests/test_rowquant_native.py`` and
``tests/test_twophase_stages.py`` check them against the torch path):
:func:`quantize_rows_into` (codes, packing, dequantised rows, residual),
:func:`dequantize_rows_into`, :func:`sign_rows_into` (one-bit codes with ``|x|`` for the
scales) and :func:`average_two_into` (a two-rank owner's decode, sum, average and residual).
The per-row reductions (the scales) stay torch's, whose bits they are.

Build: the system's C compiler (``$CC``, else ``cc``) compiles each source once per machine
(``-O3 -march=native``, under a second), into ``$SUPERNEURONS_CACHE_DIR`` (default
``~/.cache/superneurons``) under a name that holds the digest of the source, the flags, the
compiler's version and the CPU's features, written under a temporary name and renamed (two
processes building at once both end with a whole library). No compiler, a failed build or
``SUPERNEURONS_NATIVE=0``: :func:`kernels` is None and the callers keep their torch path (the
same bits, slower); the reason is logged once at INFO.

ctypes releases the GIL for the call, so a decode on gloo's callback thread runs beside the
training thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = [
    "NATIVE_ENV",
    "add_bins_into",
    "average_two_into",
    "dequantize_rows_into",
    "gap_decode_into",
    "gap_encode_into",
    "gapcode_kernels",
    "kernels",
    "quantize_rows_into",
    "rangefloat_codes_into",
    "rangefloat_kernels",
    "rangefloat_max_bits",
    "signal_divide_into",
    "signal_subtract_from",
    "spectrum_candidates_into",
    "spectrum_kernels",
]

logger = logging.getLogger(__name__)

NATIVE_ENV = "SUPERNEURONS_NATIVE"  # "0": never build or load the kernels
_ROWQUANT = Path(__file__).with_name("rowquant.c")
_SPECTRUM = Path(__file__).with_name("spectrum.c")
_RANGEFLOAT = Path(__file__).with_name("rangefloat.c")
_GAPCODE = Path(__file__).with_name("gapcode.c")
# NOTE: -ffp-contract=off: no fused multiply-add (x * f + c must round twice, as torch's two
# operations do), and no -ffast-math. -march=native: 2-3x faster than the baseline ISA here
# (AVX2, 2**18 values: 4-bit codes 75 against 172 us); the library's name holds the CPU's
# features, so a cache shared between different machines never loads another CPU's build.
_FLAGS = ("-O3", "-march=native", "-std=c99", "-ffp-contract=off", "-shared", "-fPIC")
_P = ctypes.c_void_p
_I = ctypes.c_int64


def _cache_dir() -> Path:
    given = os.environ.get("SUPERNEURONS_CACHE_DIR")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "superneurons"


def _compiler() -> tuple[str, str] | None:
    """``(path, version line)`` of the C compiler, or None."""
    path = shutil.which(os.environ.get("CC", "cc"))
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path, (done.stdout.splitlines() or [""])[0]


def _cpu() -> str:
    """What ``-march=native`` compiles for: the machine and, on Linux, the CPU's flags."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags.strip()}"


def _build(compiler: str, version: str, path: Path) -> Path:
    """The library of the source at ``path`` for these flags and this compiler, built unless
    already there."""
    source = path.read_bytes()
    parts = [source, " ".join(_FLAGS).encode(), version.encode(), _cpu().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    folder = _cache_dir()
    library = folder / f"{path.stem}-{key}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".so", dir=folder)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *_FLAGS, "-o", temporary, str(path)],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        os.replace(temporary, library)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return library


_Signature = tuple[list[type], type | None]  # a kernel's ctypes argument types, result type


def _load(path: Path, what: str, signatures: dict[str, _Signature]) -> ctypes.CDLL | None:
    """The library built from ``path`` with its kernels' ``signatures`` set, or None where it
    cannot be built (see the module)."""
    if os.environ.get(NATIVE_ENV, "1") == "0":
        logger.info("%s: off (%s=0); the torch path runs", what, NATIVE_ENV)
        return None
    found = _compiler()
    if found is None:
        logger.info("%s: no C compiler (set CC); the torch path runs", what)
        return None
    try:
        library = ctypes.CDLL(str(_build(*found, path)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # RuntimeError: no home
        detail = getattr(exc, "stderr", "") or exc
        logger.info("%s not built (%s); the torch path runs", what, detail)
        return None
    for name, (argtypes, restype) in signatures.items():
        kernel = getattr(library, name)
        kernel.argtypes, kernel.restype = argtypes, restype
    return library


_C = ctypes.c_int
_F = ctypes.c_float


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded quantisation kernels, or None where they cannot be built (see the module)."""
    return _load(_ROWQUANT, "quantisation kernels", {
        "sn_quantize_rows": ([_P, _I, _I, _C, _P, _F, _P, _P, _P, _P, _P], _C),
        "sn_dequantize_rows": ([_P, _I, _I, _C, _P, _P, _P], _C),
        "sn_average_two": ([_P, _P, _I, _I, _C, _P, _P, _P, _P, _P, _P], _C),
        "sn_sign_rows": ([_P, _I, _I, _P, _P], _C),
    })  # fmt: skip


@functools.cache
def rangefloat_kernels() -> ctypes.CDLL | None:
    """The loaded range-float kernels, or None where they cannot be built (see the module)."""
    int32 = ctypes.c_int32
    return _load(_RANGEFLOAT, "range-float kernels", {
        "sn_rangefloat_codes": ([_P, _I, int32, int32, int32, _P], _C),
        "sn_rangefloat_max_bits": ([_P, _I], int32),
    })  # fmt: skip


@functools.cache
def gapcode_kernels() -> ctypes.CDLL | None:
    """The loaded Elias-Fano coder, or None where it cannot be built (see the module)."""
    return _load(_GAPCODE, "index-code kernel", {
        "sn_gap_decode": ([_P, _I, _C, _I, _I, _P], _C),
        "sn_gap_encode": ([_P, _I, _C, _I, _I, _P], _C),
    })  # fmt: skip


@functools.cache
def spectrum_kernels() -> ctypes.CDLL | None:
    """The loaded FFT codec kernels, or None where they cannot be built (see the module)."""
    return _load(_SPECTRUM, "spectrum kernels", {
        "sn_spectrum_candidates": ([_P, _I, _I, _I, _F, _I, _P, _P, _P, _I], ctypes.c_int64),
        "sn_add_bins": ([_P, _I, _I, _P, _P, _I], _C),
        "sn_signal_divide": ([_P, _I, _F, _P], None),
        "sn_signal_subtract": ([_P, _I, _P], None),
    })  # fmt: skip


def _pointer(tensor: torch.Tensor | None, dtype: torch.dtype, numel: int) -> int | None:
    """``tensor``'s address after checking what the kernel will read or write there."""
    if tensor is None:
        return None
    if tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"a contiguous CPU {dtype} tensor is needed, got {tensor.dtype}")
    if tensor.numel() != numel:
        raise ValueError(f"expected {numel} elements, got {tensor.numel()}")
    return int(tensor.data_ptr())


def quantize_rows_into(
    library: ctypes.CDLL,
    x: torch.Tensor,
    *,
    bits: int,
    packed: torch.Tensor,
    scale: torch.Tensor,
    step: torch.Tensor | None,
    factor: torch.Tensor | None = None,
    offset: float = 0.0,
    decoded: torch.Tensor | None = None,
    error: torch.Tensor | None = None,
) -> None:
    """Codes of the rows of ``x`` (float32 ``(rows, cols)``) packed into ``packed`` (uint8,
    ``rows * cols * bits / 8``): at 1 bit ``x >= 0``, else ``trunc(x * factor + offset)``
    (``factor``: float32 ``(rows,)``); with ``decoded`` and/or ``error`` (``x``'s shape) also
    ``q * step - scale`` and ``x`` less it (``step``, ``scale``: float32 ``(rows,)``)."""
    rows, cols = x.shape
    bytes_out = rows * cols * bits // 8
    status = library.sn_quantize_rows(
        _pointer(x, torch.float32, rows * cols), rows, cols, bits,
        _pointer(factor, torch.float32, rows), offset,
        _pointer(step, torch.float32, rows), _pointer(scale, torch.float32, rows),
        _pointer(packed, torch.uint8, bytes_out),
        _pointer(decoded, torch.float32, rows * cols), _pointer(error, torch.float32, rows * cols),
    )  # fmt: skip
    if status:
        raise ValueError(f"rows of {cols} values at {bits} bits cannot be packed by the kernel")


def dequantize_rows_into(
    library: ctypes.CDLL,
    packed: torch.Tensor,
    *,
    bits: int,
    step: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out`` (float32 ``(rows, cols)``) = ``q * step - scale`` row by row, the codes ``q``
    unpacked from ``packed`` (uint8, as :func:`quantize_rows_into` packs them)."""
    rows, cols = out.shape
    status = library.sn_dequantize_rows(
        _pointer(packed, torch.uint8, rows * cols * bits // 8), rows, cols, bits,
        _pointer(step, torch.float32, rows), _pointer(scale, torch.float32, rows),
        _pointer(out, torch.float32, rows * cols),
    )  # fmt: skip
    if status:
        raise ValueError(f"rows of {cols} values at {bits} bits cannot be unpacked by the kernel")


def average_two_into(
    library: ctypes.CDLL,
    packed: tuple[torch.Tensor, torch.Tensor],
    *,
    bits: int,
    steps: tuple[torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor],
    residual: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """``out`` (float32 ``(rows, cols)``) = ``((d0 + d1) + 0) / 2`` (``+ residual``), ``d``
    each rank's copy dequantised as :func:`dequantize_rows_into` does: the two-rank owner's
    read, sum, average and residual in one pass, their bits."""
    rows, cols = out.shape
    nbytes = rows * cols * bits // 8
    status = library.sn_average_two(
        _pointer(packed[0], torch.uint8, nbytes), _pointer(packed[1], torch.uint8, nbytes),
        rows, cols, bits,
        _pointer(steps[0], torch.float32, rows), _pointer(scales[0], torch.float32, rows),
        _pointer(steps[1], torch.float32, rows), _pointer(scales[1], torch.float32, rows),
        _pointer(residual, torch.float32, rows * cols), _pointer(out, torch.float32, rows * cols),
    )  # fmt: skip
    if status:
        raise ValueError(f"rows of {cols} values at {bits} bits cannot be averaged by the kernel")


def sign_rows_into(
    library: ctypes.CDLL, x: torch.Tensor, *, packed: torch.Tensor, magnitude: torch.Tensor
) -> None:
    """One-bit codes ``x >= 0`` of the rows of ``x`` (float32 ``(rows, cols)``) packed into
    ``packed`` (uint8, ``rows * cols / 8``), and ``|x|`` into ``magnitude`` (``x``'s shape):
    the codes and what the scales are summed from, in one pass."""
    rows, cols = x.shape
    status = library.sn_sign_rows(
        _pointer(x, torch.float32, rows * cols), rows, cols,
        _pointer(packed, torch.uint8, rows * cols // 8),
        _pointer(magnitude, torch.float32, rows * cols),
    )  # fmt: skip
    if status:
        raise ValueError(f"rows of {cols} values cannot be signed by the kernel")


def spectrum_candidates_into(
    library: ctypes.CDLL,
    spectrum: torch.Tensor,
    *,
    length: int,
    low: float,
    base: int,
    positions: torch.Tensor,
    scores: torch.Tensor,
    values: torch.Tensor,
) -> int:
    """Append the bins of ``spectrum`` (complex64 ``(rows, length // 2 + 1)``, a block of rows
    of a chunked rFFT) whose weighted power (``re * re + im * im``, halved for bin 0 and, for
    even ``length``, bin ``length / 2``) is not below ``low`` (NaN included) to ``positions``
    (int64: ``base`` + the bin's flat index in the block), ``scores`` (float32) and ``values``
    (complex64), which are as long as the room left. Returns how many were written, or the
    room + 1 when more were found (the rest not written)."""
    rows, bins = spectrum.shape
    room = positions.numel()
    found = library.sn_spectrum_candidates(
        _pointer(spectrum, torch.complex64, rows * bins), rows, bins, length, low, base,
        _pointer(positions, torch.int64, room), _pointer(scores, torch.float32, room),
        _pointer(values, torch.complex64, room), room,
    )  # fmt: skip
    if found < 0:
        raise ValueError(f"{bins} bins per row do not come from a transform of length {length}")
    return int(found)


def rangefloat_codes_into(
    library: ctypes.CDLL, values: torch.Tensor, *, lo: int, mant: int, bits: int, out: torch.Tensor
) -> None:
    """``bits``-bit range-float codes (int32, sign at bit ``bits - 1``) of float32 ``values``
    into ``out``, for the window whose base binade is ``lo`` with ``mant`` mantissa bits:
    :func:`superneurons.codecs.coding.rangefloat.quantize`'s element-wise part, its bits."""
    count = values.numel()
    status = library.sn_rangefloat_codes(
        _pointer(values, torch.float32, count), count, lo, mant, bits,
        _pointer(out, torch.int32, count),
    )  # fmt: skip
    if status:
        raise ValueError(f"no range-float window has {mant} mantissa bits of {bits}")


def rangefloat_max_bits(library: ctypes.CDLL, v_bits: torch.Tensor) -> int:
    """The largest of ``v_bits & 0x7fffffff`` (int32 bit patterns of float32 values): the
    float32 bits of the largest magnitude, NaN and inf patterns above every finite one."""
    count = v_bits.numel()
    return int(library.sn_rangefloat_max_bits(_pointer(v_bits, torch.int32, count), count))


def gap_decode_into(
    library: ctypes.CDLL,
    data: torch.Tensor,
    *,
    count: int,
    low: int,
    low_bytes: int,
    upper_bits: int,
    out: torch.Tensor,
) -> bool:
    """The ``count`` sorted positions of an Elias-Fano code (``data``: uint8, ``low_bytes`` of
    ``low``-bit low parts, then an ``upper_bits``-bit upper bitmap) into int64 ``out``;
    False when the bitmap does not hold ``count`` positions."""
    need = low_bytes + -(-upper_bits // 8)
    if data.numel() < need:
        return False
    status = library.sn_gap_decode(
        _pointer(data[:need].contiguous(), torch.uint8, need), count, low, low_bytes,
        upper_bits, _pointer(out, torch.int64, count),
    )  # fmt: skip
    return status == 0


def add_bins_into(
    library: ctypes.CDLL,
    spectrum: torch.Tensor,
    *,
    base: int,
    indices: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """``spectrum[indices - base] += values`` (complex64; int64 ``indices`` in
    ``[base, base + spectrum.numel())``), in order, as ``index_add_`` adds them."""
    count = indices.numel()
    status = library.sn_add_bins(
        _pointer(spectrum, torch.complex64, spectrum.numel()), spectrum.numel(), base,
        _pointer(indices, torch.int64, count), _pointer(values, torch.complex64, count), count,
    )  # fmt: skip
    if status:
        raise ValueError(f"a bin index lies outside [{base}, {base + spectrum.numel()})")


def signal_divide_into(
    library: ctypes.CDLL, signal: torch.Tensor, divisor: float, *, out: torch.Tensor
) -> None:
    """``out = (signal + 0) / divisor`` (float32, one pass; the bits of ``add_`` then ``div``)."""
    count = signal.numel()
    library.sn_signal_divide(
        _pointer(signal, torch.float32, count), count, divisor,
        _pointer(out, torch.float32, count),
    )  # fmt: skip


def signal_subtract_from(
    library: ctypes.CDLL, signal: torch.Tensor, *, target: torch.Tensor
) -> None:
    """``target -= signal + 0`` (float32, one pass; the bits of ``add_`` then ``sub``)."""
    count = signal.numel()
    library.sn_signal_subtract(
        _pointer(signal, torch.float32, count), count, _pointer(target, torch.float32, count)
    )


def gap_encode_into(
    library: ctypes.CDLL,
    positions: torch.Tensor,
    *,
    low: int,
    low_bytes: int,
    upper_bits: int,
    out: torch.Tensor,
) -> bool:
    """The Elias-Fano code of sorted, distinct int64 ``positions`` into uint8 ``out``
    (``low_bytes`` of ``low``-bit low parts, then the ``upper_bits``-bit upper bitmap); False
    when a position lies beyond the universe the sizes describe."""
    count = positions.numel()
    need = low_bytes + -(-upper_bits // 8)
    status = library.sn_gap_encode(
        _pointer(positions, torch.int64, count), count, low, low_bytes, upper_bits,
        _pointer(out, torch.uint8, need),
    )  # fmt: skip
    return status == 0
