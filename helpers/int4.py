"""4-bit codes as the checkpoint stores them and a decode step uses them: the exact grid of a bf16 table, unpacking,
dequantizing, and packed int4 times a decode row."""

from __future__ import annotations

import torch

from .packed import GROUP_SIZE

ROWS_PER_BLOCK = 1024  # E2B's table is 2.3 G values: worked through on the host in blocks
_PEAK_LEVELS = (7, 8, 6, 5, 4, 3, 2, 1)  # the peak's level, likeliest first: QAT steps by the largest value


def _bf16_neighbours(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reals bf16 rounds to each non-negative bf16 ``bits`` (int32): halfway to each neighbour, in float32."""

    def value(b):
        return b.to(torch.int16).view(torch.bfloat16).float()

    here = value(bits)  # halves first: the sum of two numbers near float32's largest would overflow
    return value((bits - 1).clamp_min(0)) / 2 + here / 2, here / 2 + value(bits + 1) / 2


def _bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 number >= ``x`` (float32, positive)."""
    down = x.to(torch.bfloat16)
    bits = down.view(torch.int16).int() + (down.float() < x).int()
    return bits.to(torch.int16).view(torch.bfloat16).float()


def _bf16_at_most(x: torch.Tensor) -> torch.Tensor:
    """The largest bf16 number <= ``x`` (float32, positive)."""
    up = x.to(torch.bfloat16)
    bits = up.view(torch.int16).int() - (up.float() > x).int()
    return bits.to(torch.int16).view(torch.bfloat16).float()


def _bf16_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (float32) rounded to bf16, and what is left of it rounded to bf16: their sum is exact in float32."""
    high = x.to(torch.bfloat16)
    return high, (x.float() - high.float()).to(torch.bfloat16)


def recover_grid(table: torch.Tensor, group_size: int = GROUP_SIZE):
    """The 4-bit grid a QAT table lies on: int8 codes in [-8, 7] and a step per group with bf16(codes x step) the table
    bit for bit (the step may be finer than bf16, as in Google's ``-ct`` export): each value's rounding interval over
    its level bounds the step; a step in every bound is kept, bf16 if one fits, else two bf16 pieces if they fit
    (``bf16_pieces``: torch's int4 kernels take bf16 scales). Returns (codes, steps float32, found); a group on no
    grid: codes 0, step 1."""
    flat = table.float().reshape(-1, group_size)
    value = flat.to(torch.bfloat16)
    codes, steps = torch.zeros(flat.shape, dtype=torch.int8), torch.ones(flat.shape[0], dtype=torch.float32)
    found = (flat == 0).all(-1)  # an all-zero group is exact with any step
    on_bf16 = (value.float() == flat).all(-1)  # else on no bf16 grid at all
    todo = (~found & on_bf16 & torch.isfinite(flat).all(-1)).nonzero().squeeze(1)
    for k in _PEAK_LEVELS:
        if todo.numel() == 0:
            break
        v = flat[todo]
        low, high = _bf16_neighbours(value[todo].abs().view(torch.int16).int())
        levels = torch.round(v / (v.abs().amax(-1, keepdim=True) / k))
        nonzero = levels != 0
        ok = (levels.abs() <= 8).all(-1) & ~((levels.amin(-1) < -7) & (levels.amax(-1) > 7))
        ok &= (nonzero | (v == 0)).all(-1)  # a level 0 only for a zero
        size = levels.abs().clamp_min(1)
        lo = torch.where(nonzero, low / size, 0.0).amax(-1)
        hi = torch.where(nonzero, high / size, torch.inf).amin(-1)
        ok &= lo <= hi
        step, exact = torch.zeros(todo.numel(), dtype=torch.float32), torch.zeros(todo.numel(), dtype=torch.bool)
        middle = lo / 2 + hi / 2
        pair = sum(piece.float() for piece in _bf16_split(middle))  # 16 significant bits: two bf16 pieces
        for candidate in (_bf16_at_least(lo), _bf16_at_most(hi), pair, middle):
            fits = ok & ~exact & (candidate > 0) & torch.isfinite(candidate)
            fits &= ((levels.float() * candidate[:, None]).to(torch.bfloat16) == value[todo]).all(-1)
            step = torch.where(fits, candidate, step)
            exact |= fits
        flip = levels.amax(-1) > 7  # codes -7..8: negate codes and step, the values stay
        codes[todo[exact]] = torch.where(flip[:, None], -levels, levels)[exact].to(torch.int8)
        steps[todo[exact]] = torch.where(flip, -step, step)[exact]
        found[todo[exact]] = True
        todo = todo[~exact]
    return codes.reshape(table.shape), steps.reshape(table.shape[0], -1), found.reshape(table.shape[0], -1)


def exact_scales(steps: torch.Tensor) -> torch.Tensor:
    """``steps`` in bf16 if every one is a bf16 number (half the bytes), else in float32."""
    narrow = steps.to(torch.bfloat16)
    return narrow if torch.equal(narrow.float(), steps.float()) else steps.float()  # a cast, no arithmetic


def bf16_pieces(steps: torch.Tensor) -> list[torch.Tensor] | None:
    """``steps`` as bf16 numbers that sum to them exactly: one piece where each is a bf16 number, else two (each
    rounded, then its remainder); None where two are not enough."""
    high, low = _bf16_split(steps)
    if not torch.equal(high.float() + low.float(), steps.float()):
        return None
    return [high, low] if low.any() else [high]


def quantize_int4(table: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """For a table on no 4-bit grid: compressed-tensors' own symmetric int4 group quantization."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    peak = table.float().reshape(table.shape[0], -1, group_size).abs().amax(-1)
    scale, zero_point = calculate_qparams(-peak, peak, args)
    codes = quantize(table.float(), scale, zero_point, args, dtype=torch.int8)
    return codes, scale.to(torch.bfloat16)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales (one per group of 32 along the last dimension) as the grid's values."""
    return grid_values(codes, scales.float().repeat_interleave(GROUP_SIZE, dim=-1), dtype)


def grid_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales rounded to bf16, as the QAT grid's values are, then in ``dtype``."""
    return (codes.float() * scales.float()).to(torch.bfloat16).to(dtype)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int4 codes from int32 words, eight a word, low nibble first (compressed-tensors' `pack-quantized`). Written out:
    on PyTorch/XLA compressed-tensors' unpack is wrong (``>>`` of a negative int32 rounds like a division), so the
    sign bit is cleared before shifting and put back as the top nibble's. All int32: a TPU has no 64-bit integers."""
    return code_planes(packed).transpose(-1, -2).flatten(-2)


def code_planes(packed: torch.Tensor) -> torch.Tensor:
    """``unpack_rows``' codes by plane, [..., 8, words]: plane k holds every word's k-th code."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device).view(8, 1)
    top = ((shifts + 4) & 32) >> 2  # the sign bit's place: 8 in the last nibble (shift 28), 0 elsewhere
    negative = packed < packed.new_zeros(())  # an int32 zero: PyTorch/XLA compares with a Python 0 in 64 bits
    nibbles = ((packed & 0x7FFFFFFF).unsqueeze(-2) >> shifts) & 15
    return (nibbles | negative.to(torch.int32).unsqueeze(-2) * top) - 8


def packed_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, weight)`` for the weight that int32 words [out, in / 8] and scales [out, in / 32] hold, exactly the
    grid's: dequantized, then a matmul (the form for a backend with no int4 kernel)."""
    return torch.nn.functional.linear(x, dequantize(unpack_rows(packed), scales, dtype))


def kernel_refusal(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, fmt: str, kernel: str) -> str | None:
    """Why torch's kernel for ``fmt`` on ``kernel`` ("cpu", "cuda") cannot hold these codes and scales (None: it can):
    its int4 kernel for ``int4``, its int8 kernel (CPU only, one scale a row) for ``int4-bytes``. The kernels multiply
    code x scale unrounded where the checkpoint's values round each product to bf16: within the rounding a bf16 model
    makes everywhere, thousands of float32 ulps off in a float32 one."""
    if dtype != torch.bfloat16:
        return f"the model is {dtype}: the kernels multiply code x scale unrounded, the checkpoint's values are bf16's"
    finer = not torch.equal(scales.to(torch.bfloat16).float(), scales.float())
    if finer and (fmt == "int4-bytes" or kernel == "cuda"):
        return f"a scale is finer than bf16, and torch's {kernel} {fmt.replace('4-bytes', '8')} kernel takes bf16"
    if fmt == "int4-bytes":
        if kernel != "cpu":
            return "torch's int8 weight kernel is a CPU one"
        if not torch.equal(scales, scales[:, :1].expand_as(scales)):
            return "per-group scales differ within a row: torch's int8 kernel takes one scale a row"
        return None
    rows = 16 if kernel == "cpu" else 8
    if codes.shape[0] % rows or codes.shape[1] % GROUP_SIZE:
        return f"{tuple(codes.shape)}: the {kernel} kernel takes rows in {rows}s and groups of {GROUP_SIZE}"
    return None


def int4pack(codes: torch.Tensor, scales: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes -8..7 [out, in] and scales [out, in / 32] in the layout of torch's int4 kernel (``kernel``: "cpu" or
    "cuda"), on their device: unsigned codes (code + 8) packed by torch itself, and [in / 32, out, 2] scales with zero
    points of 0, so each weight is (code + 8 - 8) x scale; bf16 scales where each is a bf16 number, else float32 (the CPU
    kernel then multiplies in float32). No value is rounded again."""
    scales = exact_scales(scales)
    unsigned = codes.to(torch.int32) + 8
    if kernel == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
    else:  # two codes a byte, the first in the high nibble; tiles of 16 x inner_k_tiles along the input
        tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
        pairs = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    scales_and_zeros = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).contiguous()
    return packed, scales_and_zeros


def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel: str) -> torch.Tensor:
    """``F.linear`` through torch's int4 kernel: it reads 4 bits a weight and multiplies in one pass (a loop written by
    hand reads them far below the bandwidth). Each product is code x scale before any rounding, so the result is
    within the dtype's tolerance of the matmul on the checkpoint's (rounded) values, not equal to it. ``x`` goes in
    the scales' dtype (float32 for scales finer than bf16) and comes out in its own."""
    matmul = torch.ops.aten._weight_int4pack_mm_for_cpu if kernel == "cpu" else torch.ops.aten._weight_int4pack_mm
    out = matmul(x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype), packed, GROUP_SIZE, scales_and_zeros)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def int4pack_values(packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel: str) -> torch.Tensor:
    """The weight [out, in] as the kernel dequantizes it, read back through an identity in the scales' dtype: one term
    per output, code x scale exactly, so in bf16 the checkpoint's values; with scales of 1, the codes themselves."""
    eye = torch.eye(scales_and_zeros.shape[0] * GROUP_SIZE, dtype=scales_and_zeros.dtype, device=packed.device)
    return int4pack_linear(eye, packed, scales_and_zeros, kernel).t()
