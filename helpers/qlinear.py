"""The linears kept compressed on the device and dequantized inside the compiled step, read
straight from the checkpoint's packed tensors: the QAT int4 codes stored one per byte (format
``int4-bytes``, an int8 each: 1 byte a weight; not int8 quantization, whose values would not be
the checkpoint's) or packed eight per int32 word as compressed-tensors saved them (``int4``,
half a byte), with their bf16 group scales. Both give the checkpoint's weights exactly: codes x
scales rounded to bf16, as compressed-tensors' own dequantization does. Packed int4 times a
decode step's one row goes plane by plane through the words on a CPU, and as the dequantized
weight's matmul elsewhere (``int4.packed_linear``)."""

from __future__ import annotations

import torch

from .int4 import dequantize, exact_scales, packed_linear, recover_grid, unpack_rows
from .packed import CheckpointTensors, checkpoint_key

FORMATS = ("int4-bytes", "int4")  # codes one per byte, or eight per int32 word


class QLinear(torch.nn.Module):
    """A drop-in for a bias-free ``nn.Linear`` whose weight stays compressed on the device.

    Args: ``codes``, int8 [out, in] (format ``int4-bytes``) or int32 words [out, in / 8] (``int4``,
    compressed-tensors' ``pack-quantized`` layout); ``scales`` [out, in / 32], bf16 (the
    checkpoint's), or float32 where a grid's step is finer than bf16 (``from_linear``);
    ``dtype``, the dtype of the weight the matmul sees. ``forward(x)``: [..., in] -> [..., out]."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, fmt: str, by_planes=False):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r}: pick one of {', '.join(FORMATS)}")
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.fmt, self.dtype, self.by_planes = fmt, dtype, by_planes
        self.out_features = codes.shape[0]
        self.in_features = codes.shape[1] * (8 if fmt == "int4" else 1)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str, by_planes: bool = False) -> "QLinear":
        """From a linear whose weight lies on a 4-bit grid (its codes and scales recovered
        exactly, never re-quantized); for a model that was not loaded from a packed checkpoint."""
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        codes, scales, found = recover_grid(linear.weight.detach().cpu())
        if not found.all():
            raise ValueError(f"{int((~found).sum())} groups of this linear's weight are on no 4-bit grid")
        codes = pack_to_int32(codes, 4) if fmt == "int4" else codes
        device = linear.weight.device
        return cls(codes.to(device), exact_scales(scales).to(device), linear.weight.dtype, fmt, by_planes)

    @property
    def weight(self) -> torch.Tensor:
        """The weight, dequantized now: what every step computes before its matmul."""
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


def keep_linears_compressed(model, checkpoint, fmt: str, by_planes: bool = False) -> dict:
    """Swap every text linear for a ``QLinear`` in ``fmt``, never re-quantized: built from the
    checkpoint's own codes and scales where it saved them packed (Google's ``-ct`` export), or,
    for a checkpoint that saved no packed weight (the QAT repository's dense bf16), from each
    dense weight's own 4-bit grid, recovered exactly (a weight off its grid is refused). The
    dense weights are freed. Returns where the codes came from, the count, and bytes before and
    after; a model with no linear to swap is refused, never timed under this name. ``by_planes``:
    the packed product's form for a CPU (``int4.packed_linear``)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    before = after = 0
    built = {}
    with CheckpointTensors(checkpoint.path) as tensors:
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
        raise ValueError(
            f"{checkpoint}: no text linear to keep compressed, so nothing would be measured as {fmt} linears"
        )
    for name, q in built.items():  # swapped once every one is built: a refusal leaves the model as it was
        parent, _, child = name.rpartition(".")
        setattr(model.model.get_submodule(parent) if parent else model.model, child, q)
    source = "the checkpoint's packed codes and scales" if packed else "each dense weight's own 4-bit grid"
    return {"format": fmt, "from": source, "linears": len(built), "bytes before": before, "bytes after": after}
