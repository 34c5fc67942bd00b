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


def recover_grid(table: torch.Tensor, group_size: int = GROUP_SIZE):
    """The 4-bit grid a QAT table lies on: int8 codes in [-8, 7] and a step per group with bf16(codes x step) the table
    bit for bit (the step may be finer than bf16, as in Google's ``-ct`` export): each value's rounding interval over
    its level bounds the step; a step in every bound is kept, bf16 if one fits. Returns (codes, steps float32,
    found); a group on no grid: codes 0, step 1."""
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
        for candidate in (_bf16_at_least(lo), _bf16_at_most(hi), lo / 2 + hi / 2):
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


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, by_planes: bool = False
) -> torch.Tensor:
    """``F.linear(x, weight)`` for the weight that int32 words [out, in / 8] and scales [out, in / 32] hold, exactly the
    grid's. For a TPU: dequantized, then a matmul XLA may fuse. ``by_planes`` (a CPU's form): a decode row times the
    weight plane by plane, each word read once, shifted by a constant per plane; a CPU compiler leaves the unpacked
    form a scalar loop (``benchmarks/int4_cpu.py``: five times slower)."""
    if not by_planes or x.shape[:-1].numel() != 1:
        return torch.nn.functional.linear(x, dequantize(unpack_rows(packed), scales, dtype))
    out, words = packed.shape
    groups, per_group = scales.shape[-1], words // scales.shape[-1]  # 4 words per group of 32
    planes = code_planes(packed).view(out, 8, groups, per_group)  # [out, plane, group, word]
    weight = grid_values(planes, scales.view(out, 1, groups, 1), dtype)
    inputs = x.reshape(groups, per_group, 8).permute(2, 0, 1)  # [plane, group, word], as the weight's
    return (weight.float() * inputs.float()).sum((-3, -2, -1)).to(x.dtype).view(*x.shape[:-1], out)
