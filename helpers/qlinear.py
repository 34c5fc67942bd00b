"""Linears kept compressed on the device and dequantized in the step: the checkpoint's int4 codes a byte each
(``int4-bytes``) or eight a word (``int4``), exactly its weights."""

from __future__ import annotations

import torch

from .int4 import dequantize, exact_scales, packed_linear, recover_grid, unpack_rows
from .packed import CheckpointTensors, checkpoint_key

FORMATS = ("int4-bytes", "int4")  # codes one per byte, or eight per int32 word


class QLinear(torch.nn.Module):
    """A drop-in for a bias-free ``nn.Linear`` with ``codes`` int8 [out, in] or int32 words [out, in / 8] and ``scales``
    [out, in / 32]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, fmt: str, by_planes=False):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}: pick one of {', '.join(FORMATS)}")
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.fmt, self.dtype, self.by_planes = fmt, dtype, by_planes
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * (8 if fmt == "int4" else 1)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str, by_planes: bool = False) -> "QLinear":
        """From a linear whose weight lies on a 4-bit grid, recovered exactly (for an unpacked checkpoint)."""
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        codes, scales, found = recover_grid(linear.weight.detach().cpu())
        if not found.all():
            raise ValueError(f"{int((~found).sum())} groups of this linear's weight are on no 4-bit grid")
        codes = pack_to_int32(codes, 4) if fmt == "int4" else codes
        device = linear.weight.device
        return cls(codes.to(device), exact_scales(scales).to(device), linear.weight.dtype, fmt, by_planes)

    @property
    def weight(self) -> torch.Tensor:
        """The weight, dequantized: what every step computes before its matmul."""
        codes = unpack_rows(self.codes) if self.fmt == "int4" else self.codes
        return dequantize(codes, self.scales, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "int4":
            return packed_linear(x, self.codes, self.scales, self.dtype, self.by_planes)
        return torch.nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        scales = str(self.scales.dtype).removeprefix("torch.")
        form = ", plane by plane" if self.by_planes and self.fmt == "int4" else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt} codes, {scales} scales{form}"
        )


def keep_linears_compressed(model, folder, fmt: str, by_planes: bool = False) -> dict:
    """Swap every text linear for a ``QLinear`` in ``fmt``, from the packed codes in ``folder``, else each weight's own
    grid (off-grid refused; no linear at all refused)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    before, after, built = 0, 0, {}
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
            if packed:
                words = tensors.get(stem + "weight_packed")
                scales = tensors.get(stem + "weight_scale").to(torch.bfloat16)
                shape = torch.Size(tensors.get(stem + "weight_shape").tolist())
                codes = words if fmt == "int4" else unpack_from_int32(words, 4, shape).to(torch.int8)
                device, dtype = held[0].device, module.dtype if isinstance(module, QLinear) else module.weight.dtype
                q = QLinear(codes.to(device), scales.to(device), dtype, fmt, by_planes)
            else:
                try:
                    q = QLinear.from_linear(module, fmt, by_planes)
                except ValueError as err:
                    raise ValueError(
                        f"{name}: {err}, and the checkpoint saved no packed codes to use instead"
                    ) from None
            before += sum(t.numel() * t.element_size() for t in held)
            after += sum(t.numel() * t.element_size() for t in (q.codes, q.scales))
            built[name] = q
    if not built:
        raise ValueError(f"{folder}: no text linear to keep compressed, so nothing would be measured as {fmt} linears")
    for name, q in built.items():  # swapped once every one is built: a refusal leaves the model as it was
        parent, _, child = name.rpartition(".")
        setattr(model.model.get_submodule(parent) if parent else model.model, child, q)
    source = "the checkpoint's packed codes and scales" if packed else "each dense weight's own 4-bit grid"
    return {"format": fmt, "from": source, "linears": len(built), "bytes before": before, "bytes after": after}
