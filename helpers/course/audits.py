"""Where a model's bytes are, by kind and device; how a checkpoint's tensor names land in the text model."""

from __future__ import annotations

import torch

from ..packed import CHECKPOINT_PREFIX, TEXT_PREFIX, CheckpointTensors, text_key


def tensor_kind(name: str, tensor: torch.Tensor) -> str:
    """What a model tensor holds, by its name and dtype: packed int4, its scales, bf16, ..."""
    if name.endswith("weight_packed"):
        return "packed int4"
    if name.endswith("weight_scale"):
        return "int4 scales"
    if name.endswith("weight_shape"):
        return "int4 shapes"
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(tensor.dtype, str(tensor.dtype))


def name_map(folder) -> list[dict]:
    """How the checkpoint's tensor names land in the text model, grouped (names only, no data)."""
    groups: dict[tuple[str, str], int] = {}
    with CheckpointTensors(folder) as tensors:
        for key in tensors.keys():
            name = text_key(key)
            if name is None:
                group = (".".join(key.split(".")[:2]) + ".*", "not read (audio/vision)")
            elif name == "lm_head.weight":
                group = (key, "tied to model.embed_tokens.weight: the copy is redundant")
            else:
                group = (CHECKPOINT_PREFIX + "*", TEXT_PREFIX + "*")
            groups[group] = groups.get(group, 0) + 1
    return [{"checkpoint": c, "text model": t, "tensors": n} for (c, t), n in groups.items()]


# --- where the bytes are, and what compressed-tensors attached --------------------------------
def memory_report(model) -> list[dict]:
    """Bytes the model holds by kind (packed int4, int4 scales, bf16, ..., buffers) and device; tied tensors once."""
    seen, rows = set(), {}
    named = [(n, t, False) for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(n, t, True) for n, t in model.named_buffers(remove_duplicate=False)]
    for name, tensor, is_buffer in named:
        if id(tensor) in seen:  # identity, as parameters() dedups: XLA tensors have no data_ptr
            continue
        seen.add(id(tensor))
        kind = "buffers" if is_buffer else tensor_kind(name, tensor)
        row = rows.setdefault(
            (kind, str(tensor.device)), {"kind": kind, "device": str(tensor.device), "tensors": 0, "bytes": 0}
        )
        row["tensors"] += 1
        row["bytes"] += tensor.numel() * tensor.element_size()
    return sorted(rows.values(), key=lambda r: -r["bytes"])
