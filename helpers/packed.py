"""The checkpoint's format, as facts: compressed-tensors `pack-quantized` (symmetric int4, one
bf16 scale per group of 32, eight codes per int32 word), and where the text decoder's tensors
sit in Google's multimodal checkpoint against the text model's names."""

from __future__ import annotations

import contextlib
import os
import pathlib

import torch
from safetensors import safe_open

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


# Google's -ct export keeps its two embedding tables as bf16(level x step) with steps finer than
# bf16 (others' published measurements: no one bf16 or fp16 scale per group gives the values
# back), so storing them exactly in 4-bit keeps float32 steps: 4 bytes a group, not 2.
TABLE_SCALE_BYTES = 4


def int4_bytes(numel: int, group_size: int = GROUP_SIZE, scale_bytes: int = 2) -> int:
    """Bytes of ``numel`` values stored packed in int4 with one scale of ``scale_bytes`` per group."""
    return numel // 2 + numel // group_size * scale_bytes


# A TPU gathers more than one row of an int32 table whose rows are not a multiple of 128 words
# by reading the whole table (others' measurement on a v5e-1: 4.2 ms a step for E2B's per-layer
# table, flat in the number of ids, 0.06 ms padded; xbill9/gemma4-dev, jev-tpu-v5e1/README.md,
# "The int4 tables must be 128 columns wide").
TPU_ROW_WORDS = 128


def table_row_words(cols: int, group_size: int = GROUP_SIZE) -> int:
    """int32 words of one row of a 4-bit table laid out for a TPU (``qtable.QTable``): the row's
    codes, eight a word, then its float32 steps, one a group, then zeros to a multiple of
    ``TPU_ROW_WORDS`` (E2B's per-layer table: 1,120 + 280 words, padded to 1,408)."""
    words = cols // 8 + cols // group_size
    return -(-words // TPU_ROW_WORDS) * TPU_ROW_WORDS


def table_bytes(rows: int, cols: int) -> int:
    """Bytes of a ``rows`` x ``cols`` 4-bit table laid out for a TPU, its padding counted."""
    return rows * table_row_words(cols) * 4


def tensor_kind(name: str, tensor: torch.Tensor) -> str:
    """What a model tensor holds, by its name and dtype: packed int4, its scales, bf16, ..."""
    if name.endswith("weight_packed"):
        return "packed int4"
    if name.endswith("weight_scale"):
        return "int4 scales"
    if name.endswith("weight_shape"):
        return "int4 shapes"
    return {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}.get(tensor.dtype, str(tensor.dtype))


class CheckpointTensors:
    """A checkpoint folder's tensors by name, read on demand, whether it holds one
    ``model.safetensors`` (as Google's export does: 7.75 GiB, 2,504 tensors) or shards beside an
    index, where a packed weight and its scale may sit in different files. Use it in a ``with``:
    the files close on exit. ``keys()``, ``name in tensors``, ``tensors.get(name)``, and
    ``file(name)``, the file a tensor is in."""

    def __init__(self, folder: str | os.PathLike):
        self._files = contextlib.ExitStack()
        self._where = {}
        for path in sorted(pathlib.Path(folder).glob("*.safetensors")):
            handle = self._files.enter_context(safe_open(path, "pt"))
            self._where |= {key: (handle, path.name) for key in handle.keys()}

    def __enter__(self) -> "CheckpointTensors":
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()

    def keys(self):
        return self._where.keys()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        return self._where[name][0].get_tensor(name)

    def file(self, name: str) -> str:
        return self._where[name][1]
