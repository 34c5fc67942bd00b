"""Fewer, larger matmuls: q/k/v and gate/up as one each, weights concatenated once. Written by hand: no library fuses
Gemma 4's projections in place on every backend; each becomes a ``Part`` of one ``Fused`` linear."""

from __future__ import annotations

import torch

from .qlinear import QLinear


class Fused(torch.nn.Module):
    """One linear for several bias-free ones reading one input; ``part(x, i)``: the i-th one's rows of one matmul."""

    def __init__(self, linears: list):
        super().__init__()
        if len({type(m) for m in linears}) != 1 or len({m.in_features for m in linears}) != 1:
            raise ValueError("only linears of one kind that read the same input fuse")
        if any(getattr(m, "bias", None) is not None for m in linears):
            raise ValueError("a linear with a bias: Fused keeps bias-free linears only")
        first = linears[0]
        if isinstance(first, QLinear):  # the checkpoint's codes and scales, concatenated, stored as the parts were
            codes, scales = (torch.cat(parts) for parts in zip(*(m.unpacked() for m in linears)))
            self.linear = QLinear.of(codes, scales, first.dtype, first.fmt, first.kernel)
        else:
            weight = torch.cat([m.weight.detach() for m in linears])
            self.linear = torch.nn.Linear(first.in_features, weight.shape[0], bias=False, device="meta")
            self.linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.sizes = [m.out_features for m in linears]
        self._last = None  # (input, outputs) from the first part's call to the last's

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self._last is None or self._last[0] is not x:
            self._last = (x, self.linear(x).split(self.sizes, dim=-1))
        out = self._last[1][i]
        if i == len(self.sizes) - 1:
            self._last = None  # hold no activation between steps (nor a compiled graph's output)
        return out


class Part(torch.nn.Module):
    """The i-th linear of a ``Fused`` one, where that linear was (``q_proj``, ``k_proj``, ...)."""

    def __init__(self, fused: Fused, i: int):
        super().__init__()
        self.__dict__["fused"] = fused  # not a child: the fused weights are counted once, under their parent
        self.i, self.in_features, self.out_features = i, fused.linear.in_features, fused.sizes[i]

    @property
    def weight(self) -> torch.Tensor:
        start = sum(self.fused.sizes[: self.i])
        return self.fused.linear.weight[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.part(x, self.i)

    def extra_repr(self) -> str:
        return f"part {self.i} of a fused linear, out_features={self.out_features}"


def fuse_projections(model) -> dict:
    """Fuse q/k/v (q/k where k is also v; none in a K/V-sharing layer: only q) and gate/up in every layer, in place."""
    linears = matmuls = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups = [(mlp, "gate_up", ["gate_proj", "up_proj"])]
        if not attn.is_kv_shared_layer:
            groups.append((attn, "qkv", ["q_proj", "k_proj"] + (["v_proj"] if attn.v_proj is not None else [])))
        for parent, fused_name, names in groups:
            parts = [getattr(parent, name) for name in names]
            if any(isinstance(m, Part) for m in parts):
                raise ValueError("this model's projections are fused already")
            fused = Fused(parts)
            parent.add_module(fused_name, fused)
            for i, name in enumerate(names):
                setattr(parent, name, Part(fused, i))
            linears, matmuls = linears + len(names), matmuls + 1
    return {"linears fused": linears, "matmuls now": matmuls}


def linear_calls(model, ids: torch.Tensor) -> int:
    """Matmuls with a weight (``F.linear`` calls) in one forward over ``ids``, counted eagerly."""

    class Count(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.calls += func is torch.nn.functional.linear
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        model(input_ids=ids, use_cache=False)  # no cache: XLA refuses a sliding cache's slice past its start
    return Count.calls
