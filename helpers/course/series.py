"""The series so far, in one call: the model as notebook N leaves it, with the prompt, length and notebook 03's
reference tokens, so the recipe (load, first forward, strip, 4-bit table) is written once, in the notebooks' order."""

import dataclasses
import hashlib
import json

import torch

from .. import checkpoint as ck
from .. import decode, generate, qtable, ring
from ..backend import Backend
from . import hub, verdict
from .report import run_dir, update_json


@dataclasses.dataclass
class Series:
    """What the series has built so far on one backend."""

    checkpoint: hub.Checkpoint
    model: torch.nn.Module  # the text decoder on the backend's device
    tokenizer: object
    ids: torch.Tensor  # the series' chat prompt, [1, L] int64 on the device, BOS first
    new_tokens: int  # the series' generation length on this backend
    reference: list[int]  # notebook 03's tokens (HF generate), up to and including the stop
    timed_tokens: int  # tokens per timed run on this backend (``Backend.timed_length``)
    table: dict | None = None  # notebook 05's report, once the per-layer table is in 4-bit
    _reference_model: torch.nn.Module | None = dataclasses.field(default=None, repr=False)
    _verdicts: dict = dataclasses.field(default_factory=dict, repr=False)  # tokens -> Verdict

    def same_tokens(self, tokens: list[int]) -> verdict.Verdict:
        """Whether ``tokens`` (cut to ``new_tokens``) are notebook 03's, teacher-forced against the
        reference model: programs round differently with threads, CPU and compiler."""
        key = tuple(tokens[: self.new_tokens])  # one teacher-forced forward per distinct list: seconds each at E2B
        if key not in self._verdicts:  # looked up first: a dropped reference model is rebuilt only when needed
            self._verdicts[key] = verdict.compare_tokens(list(key), self.reference, self.reference_model(), self.ids)
        return self._verdicts[key]

    def reference_model(self) -> torch.nn.Module:
        """The reference model "the same tokens" is judged against, on the host, built on first use."""
        if self._reference_model is None:
            self._reference_model = verdict.reference_model(self.checkpoint, hub.series_dtype(self.checkpoint))
        return self._reference_model

    def drop_reference_model(self) -> None:
        """Free the reference model (9 GB of host memory at E2B) until a verdict needs it; verdicts made are kept."""
        self._reference_model = None


def load_for_series(backend: Backend):
    """Notebook 02's checkpoint, model, tokenizer and prompt (the twin in float32, its matmuls exact on a TPU)."""
    checkpoint = hub.choose_checkpoint(backend)
    dtype = hub.series_dtype(checkpoint)
    if dtype == torch.float32:
        backend.set_float32_matmuls_exact()
    dequantize = not verdict.unpack_is_exact(backend.device)
    print(hub.preflight(ck.text_config(ck.read_config(checkpoint.path)), backend, dequantize))
    model, _ = ck.load(checkpoint.path, backend, dtype=dtype, dequantize=dequantize)
    tokenizer = ck.load_tokenizer(checkpoint.path)
    return checkpoint, model, tokenizer, ck.chat_ids(tokenizer, backend.device)


def prepare(backend: Backend, after: int = 3, folder=None) -> Series:
    """The model as notebook ``after`` leaves it: 3 loaded, with notebook 03's reference tokens (made now if none are
    saved); 4 decompressed, compressed-tensors' wrappers stripped; 5 per-layer table in 4-bit; 6 attention grouped."""
    if after not in (3, 4, 5, 6):
        raise ValueError(f"after={after}: the series can be prepared as notebook 3, 4, 5 or 6 leaves it")
    checkpoint, model, tokenizer, ids = load_for_series(backend)
    print(f"{checkpoint}\n{hub.describe(backend)}")
    new_tokens = backend.generation_length
    try:
        reference = load_reference(checkpoint, backend, ids, new_tokens, folder)
    except LookupError:
        print("no reference tokens from notebook 03 in this run folder: making them with HF generate now")
        reference, _, _ = generate.generate(model, tokenizer, ids, backend, new_tokens)
        save_reference(checkpoint, backend, ids, new_tokens, reference, folder)
    series = Series(checkpoint, model, tokenizer, ids, new_tokens, reference, backend.timed_length)
    if after >= 4:
        with torch.no_grad():
            model(ids)  # the first forward decompresses the weights, as generate's did
        decode.strip_compressed_wrappers(model)
    if after >= 5:
        series.table = qtable.keep_table_in_4bit(model, checkpoint.path)
    if after >= 6:
        ring.group_query_heads(model)
    return series


def reference_key(checkpoint, backend: Backend, ids: torch.Tensor, new_tokens: int) -> str:
    """Model, backend, prompt and length: a reference is only valid for the same four."""
    prompt = hashlib.sha256(json.dumps(ids[0].tolist()).encode()).hexdigest()[:12]
    return f"{checkpoint.name}|{backend.name}|prompt {prompt}|{new_tokens} tokens"


def save_reference(
    checkpoint, backend: Backend, ids: torch.Tensor, new_tokens: int, tokens: list[int], folder=None
) -> str:
    """Save the tokens a run of at most ``new_tokens`` gave (fewer when it stopped); returns their key."""
    key = reference_key(checkpoint, backend, ids, new_tokens)
    update_json(run_dir(folder) / "reference_tokens.json", lambda saved: {**saved, key: tokens})
    return key


def load_reference(checkpoint, backend: Backend, ids: torch.Tensor, new_tokens: int, folder=None) -> list[int]:
    """The reference tokens notebook 03 saved for this model, backend, prompt and length."""
    path = run_dir(folder) / "reference_tokens.json"
    key = reference_key(checkpoint, backend, ids, new_tokens)
    saved = json.loads(path.read_text()) if path.exists() else {}
    if key not in saved:
        known = "; ".join(saved) or "none"
        raise LookupError(
            f"no reference tokens for {key} in {path} (saved: {known}): run notebook 03 first, same settings"
        )
    return saved[key]
