"""The checkpoint's format, as facts: compressed-tensors `pack-quantized` (symmetric int4, one
bf16 scale per group of 32, eight codes per int32 word), and where the text decoder's tensors
sit in Google's multimodal checkpoint against the text model's names."""

from __future__ import annotations

import torch

GROUP_SIZE = 32  # values per bf16 scale: the checkpoint's int4 groups (and the 4-bit tables')
# The multimodal checkpoint keeps the text decoder under model.language_model.*; the text
# model (Gemma4ForCausalLM) calls it model.*. lm_head is top-level in both.
KEY_MAPPING = {r"^model\.language_model\.": "model."}
CHECKPOINT_PREFIX, TEXT_PREFIX = "model.language_model.", "model."


def text_key(checkpoint_key: str) -> str | None:
    """The text model's name for a checkpoint tensor (None for audio/vision tensors)."""
    if checkpoint_key.startswith(CHECKPOINT_PREFIX):
        return TEXT_PREFIX + checkpoint_key[len(CHECKPOINT_PREFIX) :]
    return checkpoint_key if checkpoint_key.startswith("lm_head.") else None


def checkpoint_key(text_model_key: str) -> str:
    """The checkpoint's name for a text-model tensor (the inverse of ``text_key``)."""
    if text_model_key.startswith(TEXT_PREFIX):
        return CHECKPOINT_PREFIX + text_model_key[len(TEXT_PREFIX) :]
    return text_model_key


def int4_bytes(numel: int, group_size: int = GROUP_SIZE, scale_bytes: int = 2) -> int:
    """Bytes of ``numel`` values stored packed in int4 with one bf16 scale per group."""
    return numel // 2 + numel // group_size * scale_bytes


def tensor_kind(name: str, tensor: torch.Tensor) -> str:
    """What a model tensor holds, by its name and dtype: packed int4, its scales, bf16, ..."""
    if name.endswith("weight_packed"):
        return "packed int4"
    if name.endswith("weight_scale"):
        return "int4 scales"
    if name.endswith("weight_shape"):
        return "int4 shapes"
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(tensor.dtype, str(tensor.dtype))
