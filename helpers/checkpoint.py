"""Loading a Gemma 4 E2B checkpoint from its folder onto a device and giving it back; its tokenizer and the series'
prompt."""

from __future__ import annotations

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
    KEY_MAPPING,
)

PROMPT = "Explain why compilation matters on a TPU, in two sentences."  # the series' prompt, every step


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says what to do."""


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


def load(folder, backend: Backend, dtype: torch.dtype = torch.bfloat16, dequantize: bool = False):
    """The text decoder in ``folder`` on the device, and the seconds it took (no audio or vision). ``dequantize=False``:
    compressed-tensors' default, packed int4 expanded at the first forward; ``True``: dense at load."""
    from transformers import CompressedTensorsConfig, Gemma4ForCausalLM
    from transformers.utils import logging as hf_logging

    start = time.perf_counter()
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


def unique_tensors(module) -> dict[int, torch.Tensor]:
    """A module's parameters and buffers, each once: by identity (tied weights are one tensor)."""
    return {id(t): t for t in [*module.parameters(), *module.buffers()]}


def unload(model, backend: Backend) -> None:
    """Give a model's memory back before the next load: compressed-tensors' bound forwards (reference cycles) and a
    notebook's outputs may still hold it, so its tensors go to the meta device first."""
    from compressed_tensors.offload import remove_dispatch

    held = sum(t.numel() * t.element_size() for t in unique_tensors(model).values())
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
    """Every text tensor was read; only audio/vision tensors (and the tied lm_head copy) were left out."""
    if info["missing_keys"] or info["mismatched_keys"]:
        raise CheckpointError(
            f"checkpoint lacks or mismatches text tensors: "
            f"{sorted(info['missing_keys'] | set(info['mismatched_keys']))[:5]}"
        )
    stray = [k for k in info["unexpected_keys"] if not re.search(r"(audio|vision)", k)]
    if stray:
        raise CheckpointError(f"checkpoint has text tensors the model does not know: {sorted(stray)[:5]}")


def load_tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def encode(tokenizer, text: str, device) -> torch.Tensor:
    """Token ids of ``text`` with BOS, which Gemma's tokenizer does not add (without it the model echoes the prompt)."""
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
