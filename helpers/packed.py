"""The checkpoint's format as facts (symmetric int4, a bf16 scale per group of 32, eight codes a word) and where the
text decoder's tensors are."""

from __future__ import annotations

import contextlib
import os
import pathlib

import torch
from safetensors import safe_open

GROUP_SIZE = 32  # values per bf16 scale: the checkpoint's int4 groups (and the 4-bit tables')
# The checkpoint's model.language_model.* is the text model's (Gemma4ForCausalLM) model.*; lm_head is top-level in both.
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


# Google's -ct export keeps its embedding tables as bf16(level x step), steps finer than bf16: float32 steps keep them
TABLE_SCALE_BYTES = 4


# A TPU gathers rows of an int32 table not 128 words wide by reading it whole (a v5e-1: 4.2 ms a step for E2B's
# per-layer table, 0.06 ms padded; xbill9/gemma4-dev, jev-tpu-v5e1/README.md, "The int4 tables must be 128 columns wide")
TPU_ROW_WORDS = 128


def table_row_words(cols: int, group_size: int = GROUP_SIZE) -> int:
    """int32 words in one row of a TPU 4-bit table, padded to a multiple of ``TPU_ROW_WORDS`` (E2B's per-layer table:
    1,408)."""
    words = cols // 8 + cols // group_size
    return -(-words // TPU_ROW_WORDS) * TPU_ROW_WORDS


class CheckpointTensors:
    """A checkpoint folder's tensors by name, read on demand from one ``model.safetensors`` or shards; use it in a
    ``with``."""

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
