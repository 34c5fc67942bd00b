"""The series so far, in one call: the model as notebook N leaves it, with the series' prompt,
generation length and notebook 03's reference tokens. Notebooks 04-06, the tour and the tests
start from it, so the recipe (load, first forward, strip, 4-bit table) is written once."""

from __future__ import annotations

import dataclasses

import torch

from . import decode, generate, qtable
from .backend import Backend
from .checkpoint import generation_length
from .hub import Checkpoint


@dataclasses.dataclass
class Series:
    """What the series has built so far on one backend."""

    checkpoint: Checkpoint
    model: torch.nn.Module  # the text decoder on the backend's device
    tokenizer: object
    ids: torch.Tensor  # the series' chat prompt, [1, L] int64 on the device, BOS first
    new_tokens: int  # the series' generation length on this backend
    reference: list[int]  # notebook 03's tokens (HF generate), up to and including the stop
    table: dict | None = None  # notebook 05's report, once the per-layer table is in 4-bit


def prepare(backend: Backend, after: int = 3, folder=None) -> Series:
    """The model as notebook ``after`` leaves it. 3: loaded as the series loads it, with
    notebook 03's reference tokens from the run folder (made now, and said so, if it has none);
    4: also decompressed by a first forward and stripped of compressed-tensors' wrappers;
    5: also the per-layer table in 4-bit. Prints which checkpoint and backend."""
    if after not in (3, 4, 5):
        raise ValueError(f"after={after}: the series can be prepared as notebook 3, 4 or 5 leaves it")
    checkpoint, model, tokenizer, ids = generate.load_for_series(backend)
    print(checkpoint)
    print(backend.describe())
    new_tokens = generation_length(backend)
    reference = generate.reference_tokens(checkpoint, model, tokenizer, ids, backend, new_tokens, folder)
    series = Series(checkpoint, model, tokenizer, ids, new_tokens, reference)
    if after >= 4:
        with torch.no_grad():
            model(ids)  # the first forward decompresses the weights, as generate's did
        decode.strip_compressed_wrappers(model)
    if after >= 5:
        series.table = qtable.keep_table_in_4bit(model, checkpoint)
    return series
