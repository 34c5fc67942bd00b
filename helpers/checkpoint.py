"""Loading a Gemma 4 E2B checkpoint (chosen and fetched by `helpers.course.hub`): refuse what cannot fit, load
its text decoder onto a device, see where the bytes go, give them back; the series' prompt and
a reference model dequantized independently. The real checkpoint and the tiny twin go through
the same code."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import pathlib
import re
import time
import warnings

import torch

from .backend import Backend
from .packed import (
    CHECKPOINT_PREFIX,
    KEY_MAPPING,
    TEXT_PREFIX,
    CheckpointTensors,
    tensor_kind,
    text_key,
)

PROMPT = "Explain why compilation matters on a TPU, in two sentences."  # the series' prompt, every step


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says what to do."""


@dataclasses.dataclass
class Checkpoint:
    """Where the weights come from, and why: printed first, so a reader knows what ran."""

    source: str  # a repo id or a local folder
    revision: str | None
    tiny: bool
    reason: str
    folder: str | None = None  # where ``source`` was fetched to once (a download, or the Hub's cache)
    synthetic: bool = False  # E2B's layout with random weights (``helpers.course.synthetic``)

    @property
    def name(self) -> str:
        """A stable name for the weights: the repo id and revision, or the twin's folder name."""
        return pathlib.Path(self.source).name if self.tiny else f"{self.source}@{self.revision or 'main'}"

    @property
    def path(self) -> pathlib.Path:
        """The folder the weights are read from: ``folder``, resolved once where the checkpoint was
        chosen (``helpers.choose_checkpoint`` fetches what it chooses), or ``source`` itself when it
        is a folder. Reading never goes to the Hub."""
        path = pathlib.Path(self.folder or self.source)
        if not path.is_dir():
            raise CheckpointError(
                f"{self.source} is not a local folder and was not fetched: helpers.choose_checkpoint fetches "
                "what it chooses (helpers.course.hub.fetch fetches a checkpoint made by hand)."
            )
        return path

    def __str__(self) -> str:
        rev = f" @ {self.revision}" if self.revision else ""
        kind = "tiny offline twin" if self.tiny else "synthetic checkpoint" if self.synthetic else "real checkpoint"
        return f"{kind}: {self.source}{rev} ({self.reason})"


def name_map(checkpoint: Checkpoint) -> list[dict]:
    """How the checkpoint's tensor names land in the text model, grouped (names only, no data)."""
    groups: dict[tuple[str, str], int] = {}
    with CheckpointTensors(checkpoint.path) as tensors:
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


# --- the dtype and the config ----------------------------------------------------------------
def series_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """bf16 for the real model; float32 for the tiny twin, where the series compares tokens
    across programs that sum in different orders (eager and fused, cached and uncached, ring
    and no cache) on prompts the twin never learned. There its logits can be close, and bf16
    rounds each program differently (measured on xla with an untrained twin: eager and
    defer-and-fuse differed from the 4th token on), so token identity would test rounding, not
    code. On the chat turns it learned, its greedy answers are the same in bf16 (top-2 logit
    gaps of 5.5 or more, measured). Its 4-bit-grid weights are exact in either dtype."""
    return torch.float32 if checkpoint.tiny else torch.bfloat16


def read_config(folder: str | os.PathLike):
    """The checkpoint's config, refused in one line unless it is a Gemma 4 checkpoint."""
    from transformers import AutoConfig

    path = pathlib.Path(folder) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face checkpoint folder.")
    model_type = json.loads(path.read_text()).get("model_type")
    if model_type not in ("gemma4", "gemma4_text"):
        raise CheckpointError(f"{folder} holds a {model_type!r} model, not Gemma 4 (model_type 'gemma4').")
    return AutoConfig.from_pretrained(folder)


def text_config(config):
    """The text decoder's config, carrying the checkpoint's quantization config along."""
    text = getattr(config, "text_config", config)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        text.quantization_config = quantization
    return text


# --- loading ---------------------------------------------------------------------------------
def load(checkpoint: Checkpoint, backend: Backend, dtype: torch.dtype = torch.bfloat16, dequantize: bool = False):
    """The text decoder of ``checkpoint`` on the device, and the seconds it took.

    ``dequantize=False`` is compressed-tensors' default path: packed int4 weights, module
    forwards wrapped, and everything expanded to ``dtype`` on the first forward.
    ``dequantize=True`` expands at load into plain dense modules. Audio and vision towers
    are never built: only the text decoder's tensors are read.
    """
    from transformers import CompressedTensorsConfig, Gemma4ForCausalLM
    from transformers.utils import logging as hf_logging

    start = time.perf_counter()
    folder = checkpoint.path
    config = text_config(read_config(folder))
    quantization = (
        CompressedTensorsConfig(dequantize=dequantize) if getattr(config, "quantization_config", None) else None
    )
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists every tower tensor; we check them below instead
    try:
        with warnings.catch_warnings():
            # "the model already has a quantization_config": yes, and ours only sets `dequantize`
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            model, info = Gemma4ForCausalLM.from_pretrained(
                folder,
                config=config,
                key_mapping=KEY_MAPPING,
                dtype=dtype,
                device_map=backend.load_device_map,
                quantization_config=quantization,
                output_loading_info=True,
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    _check_loading_info(info)
    backend.place(model)
    model.eval()
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise CheckpointError("lm_head is no longer tied to embed_tokens after placement on the device.")
    backend.sync()
    return model, time.perf_counter() - start


def unload(model, backend: Backend) -> None:
    """Give a model's memory back before the next load, and print device bytes before and after.

    ``del model`` is not enough: compressed-tensors binds forwards onto modules (reference
    cycles, freed only by a garbage collection), and a notebook's output history may hold the
    model too. So every tensor moves to the meta device (no memory) first, wherever the model
    is still referenced, then Python collects and the allocator hands its cache back."""
    from compressed_tensors.offload import remove_dispatch

    held = sum(row["bytes"] for row in memory_report(model))
    before = backend.memory()
    remove_dispatch(model)  # its offload cache would copy into the old tensors instead of letting go
    model.to("meta")
    gc.collect()
    backend.empty_cache()
    line = f"unloaded the model ({held / 1e9:.2f} GB of tensors)"
    if before is not None:
        line += f"; device memory in use {before['in_use'] / 1e9:.2f} -> {backend.memory()['in_use'] / 1e9:.2f} GB"
    print(line)


def _check_loading_info(info: dict) -> None:
    """Every text tensor was read, and nothing but audio/vision tensors (and the redundant
    lm_head copy, tied to embed_tokens) was left out."""
    if info["missing_keys"] or info["mismatched_keys"]:
        raise CheckpointError(
            f"checkpoint lacks or mismatches text tensors: "
            f"{sorted(info['missing_keys'] | set(info['mismatched_keys']))[:5]}"
        )
    stray = [k for k in info["unexpected_keys"] if not re.search(r"(audio|vision)", k)]
    if stray:
        raise CheckpointError(f"checkpoint has text tensors the model does not know: {sorted(stray)[:5]}")


def load_tokenizer(checkpoint: Checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint.path)


def encode(tokenizer, text: str, device) -> torch.Tensor:
    """Token ids of ``text`` with BOS in front: Gemma's tokenizer does not add it, and
    without BOS the model echoes the prompt."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    if ids.shape[1] == 0 or ids[0, 0] != tokenizer.bos_token_id:
        ids = torch.cat([torch.tensor([[tokenizer.bos_token_id]]), ids], dim=1)
    return ids.to(device)


def chat_ids(tokenizer, device, prompt: str = PROMPT) -> torch.Tensor:
    """The prompt as a user turn through the tokenizer's own chat template, BOS in front."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return encode(tokenizer, text, device)


# --- where the bytes are, and what compressed-tensors attached --------------------------------


def memory_report(model) -> list[dict]:
    """Bytes held by the model, by kind (packed int4, int4 scales, bf16, fp32, ..., buffers)
    and by device; a tensor shared by two names (tied weights) is counted once."""
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


def compression_report(model) -> list[dict]:
    """What compressed-tensors attached: wrapped module forwards, hooks, quantization status."""
    wrapped = [
        n
        for n, m in model.named_modules()  # an instance forward other than the class's own
        if "forward" in m.__dict__ and getattr(m.forward, "__func__", None) is not type(m).forward
    ]
    status = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_status", None) is not None:
            status.setdefault(str(module.quantization_status.value), []).append(name)
    hooks = [n or "(model)" for n, m in model.named_modules() if m._forward_pre_hooks or m._forward_hooks]
    rows = [
        {"what": "modules with a wrapped forward", "count": len(wrapped), "example": (wrapped or ["-"])[0]},
        {"what": "modules with forward hooks", "count": len(hooks), "example": (hooks or ["-"])[0]},
    ]
    rows += [
        {"what": f"quantization status '{s}'", "count": len(names), "example": names[0]} for s, names in status.items()
    ]
    return rows
