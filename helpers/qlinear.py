"""Linears kept compressed on the device: the checkpoint's int4 codes a byte each (``int4-bytes``) or four bits each
(``int4``), through torch's own weight kernels where the backend has them, else dequantized in the step."""

from __future__ import annotations

import torch

from .int4 import (
    dequantize,
    exact_scales,
    int4pack,
    int4pack_linear,
    int4pack_values,
    kernel_refusal,
    packed_linear,
    recover_grid,
    unpack_rows,
)
from .packed import GROUP_SIZE, CheckpointTensors, checkpoint_key

FORMATS = ("int4-bytes", "int4")  # codes one per byte, or four bits each


class QLinear(torch.nn.Module):
    """A drop-in for a bias-free ``nn.Linear``, built by ``QLinear.of`` from the checkpoint's codes and scales. Its
    buffers: ``int4-bytes``: codes int8 [out, in] and scales [out, in / 32] (or one scale per row, for torch's int8
    kernel); ``int4``: int32 words [out, in / 8] and scales, or with ``kernel`` the int4 kernel's packed codes and
    its [in / 32, out, 2] scales and zero points."""

    def __init__(self, codes, scales, dtype: torch.dtype, fmt: str, kernel: str | None = None, shape=None):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}: pick one of {', '.join(FORMATS)}")
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.fmt, self.dtype, self.kernel = fmt, dtype, kernel
        self.out_features, self.in_features = shape

    @classmethod
    def of(cls, codes, scales, dtype: torch.dtype, fmt: str, kernel: str | None = None, device=None) -> "QLinear":
        """From codes -8..7 [out, in] and scales [out, in / 32]: stored in ``fmt`` on ``device``, through torch's
        kernel for ``kernel`` ("cpu", "cuda": ``Backend.int4_kernel``) where it holds them exactly, repacked once."""
        device = device or codes.device
        refusal = kernel and kernel_refusal(codes, scales, dtype, fmt, kernel)
        if kernel and not refusal:
            if fmt == "int4":
                stored = int4pack(codes.to(device), scales.to(device), kernel)
            else:
                stored = codes, scales[:, 0].to(dtype)  # torch's int8 kernel: one scale a row
        else:
            kernel = None
            stored = (pack_words(codes) if fmt == "int4" else codes.to(torch.int8)), scales
        q = cls(*(t.to(device) for t in stored), dtype, fmt, kernel, tuple(codes.shape))
        q.refusal = refusal or None  # why the kernel asked for is not used, shown by keep_linears_compressed
        return q

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str, kernel: str | None = None) -> "QLinear":
        """From a linear whose weight lies on a 4-bit grid, recovered exactly (for an unpacked checkpoint)."""
        codes, scales, found = recover_grid(linear.weight.detach().cpu())
        if not found.all():
            raise ValueError(f"{int((~found).sum())} groups of this linear's weight are on no 4-bit grid")
        return cls.of(codes, exact_scales(scales), linear.weight.dtype, fmt, kernel, linear.weight.device)

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The checkpoint's codes int8 [out, in] and scales [out, in / 32], exactly, from any form."""
        if self.fmt == "int4-bytes":
            groups = self.in_features // GROUP_SIZE
            scales = self.scales if self.scales.dim() == 2 else self.scales[:, None].expand(-1, groups)
            return self.codes, scales
        if self.kernel is None:
            return unpack_rows(self.codes).to(torch.int8), self.scales
        units = torch.stack([torch.ones_like(self.scales[..., 0]), self.scales[..., 1]], dim=-1)
        return int4pack_values(self.codes, units, self.kernel).to(torch.int8), self.scales[..., 0].t()

    @property
    def weight(self) -> torch.Tensor:
        """The weight, dequantized: through the kernel's own reading where it has one (exactly the checkpoint's)."""
        if self.kernel and self.fmt == "int4":
            return int4pack_values(self.codes, self.scales, self.kernel).to(self.dtype)
        return dequantize(*self.unpacked(), self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel and self.fmt == "int4":
            return int4pack_linear(x, self.codes, self.scales, self.kernel)
        if self.kernel:  # int8 codes, one scale a row
            return torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.codes, self.scales).view(
                *x.shape[:-1], self.out_features
            )
        if self.fmt == "int4":
            return packed_linear(x, self.codes, self.scales, self.dtype)
        return torch.nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        form = f"torch's {self.kernel} {'int4' if self.fmt == 'int4' else 'int8'} kernel"
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt} codes, " + (
            form if self.kernel else "dequantized in the step"
        )


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """Codes -8..7 [out, in] as compressed-tensors' int32 words, eight a word."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(codes.cpu(), 4).to(codes.device)


def keep_linears_compressed(model, folder, fmt: str, kernel: str | None = None) -> dict:
    """Swap every text linear for a ``QLinear`` in ``fmt`` (through ``kernel`` where it holds them exactly), from the
    packed codes in ``folder``, else each weight's own grid (off-grid refused; no linear at all refused)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    before, after, built, refusals = 0, 0, {}, set()
    with CheckpointTensors(folder) as tensors:
        packed = any(key.endswith(".weight_packed") for key in tensors.keys())
        for name, module in list(model.model.named_modules()):
            stem = checkpoint_key(f"model.{name}") + "."
            if not hasattr(module, "in_features") or (packed and stem + "weight_packed" not in tensors):
                continue  # not a linear, or one the checkpoint did not pack (a table saved packed is QTable's)
            if not isinstance(module, (torch.nn.Linear, QLinear)):
                raise ValueError(
                    f"{name} is a {type(module).__name__}, not a linear (fused projections?): keep the linears "
                    "compressed first, then fuse them"
                )  # a QLinear already there is rebuilt in the format asked for below
            if getattr(module, "bias", None) is not None:
                raise ValueError(f"{name} has a bias: QLinear keeps bias-free linears only")
            held = [module.codes, module.scales] if isinstance(module, QLinear) else [module.weight]
            dtype = module.dtype if isinstance(module, QLinear) else module.weight.dtype
            if packed:
                shape = torch.Size(tensors.get(stem + "weight_shape").tolist())
                codes = unpack_from_int32(tensors.get(stem + "weight_packed"), 4, shape).to(torch.int8)
                scales = tensors.get(stem + "weight_scale").to(torch.bfloat16)
                q = QLinear.of(codes, scales, dtype, fmt, kernel, held[0].device)
            else:
                try:
                    q = QLinear.from_linear(module, fmt, kernel)
                except ValueError as err:
                    raise ValueError(
                        f"{name}: {err}, and the checkpoint saved no packed codes to use instead"
                    ) from None
            if q.refusal:
                refusals.add(q.refusal)
            before += sum(t.numel() * t.element_size() for t in held)
            after += sum(t.numel() * t.element_size() for t in (q.codes, q.scales))
            built[name] = q
    if not built:
        raise ValueError(f"{folder}: no text linear to keep compressed, so nothing would be measured as {fmt} linears")
    for name, q in built.items():  # swapped once every one is built: a refusal leaves the model as it was
        parent, _, child = name.rpartition(".")
        setattr(model.model.get_submodule(parent) if parent else model.model, child, q)
    source = "the checkpoint's packed codes and scales" if packed else "each dense weight's own 4-bit grid"
    kernels = sum(q.kernel is not None for q in built.values())
    return {
        "format": fmt,
        "from": source,
        "linears": len(built),
        "through torch's kernel": f"{kernels} of {len(built)}"
        + (f" ({'; '.join(sorted(refusals))})" if refusals else ""),
        "bytes before": before,
        "bytes after": after,
    }
