"""Loading a Gemma 4 E2B checkpoint (chosen and fetched by `helpers.hub`): refuse what cannot fit, load
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
from .e2b import CONTEXT, estimate_device_bytes, fit_options
from .packed import (
    CHECKPOINT_PREFIX,
    GROUP_SIZE,
    KEY_MAPPING,
    TEXT_PREFIX,
    CheckpointTensors,
    tensor_kind,
    text_key,
)
from .sampling import greedy_config
from .tables import fmt_bytes
from .timing import host_peak_bytes

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
    synthetic: bool = False  # E2B's layout with random weights (``helpers.synthetic``)

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
                "what it chooses (helpers.hub.fetch fetches a checkpoint made by hand)."
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


# --- preflight: refuse before loading what cannot fit ----------------------------------------
def preflight(
    config, backend: Backend, dequantize: bool, available: int | None = None, where: str | None = None
) -> str:
    """Refuse, with needed vs available bytes and what to change, a load that will not fit.

    ``available`` and ``where`` describe another device than this backend's (a what-if)."""
    needed = estimate_device_bytes(config, dequantize)
    available = backend.free_bytes() if available is None else available
    where = where or backend.name
    if available is None:
        return f"preflight: needs ~{fmt_bytes(needed)}; {where} does not report its free memory"
    if needed > available:
        raise CheckpointError(
            f"will not fit: needs ~{fmt_bytes(needed)} on {where}, {fmt_bytes(available)} free; "
            "free the device (restart the runtime), load the tiny twin (HELPERS_MODEL=tiny), or pick a larger device; "
            "what the later notebooks keep smaller at E2B: "
            + "; ".join(f"{o['option']} saves {fmt_bytes(o['saves'])}" for o in fit_options(config, CONTEXT))
        )
    return f"preflight: needs ~{fmt_bytes(needed)} of {fmt_bytes(available)} free on {where}: fits"


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
    print(preflight(config, backend, dequantize))
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
    line = f"unloaded the model ({fmt_bytes(held)} of tensors)"
    if before is not None:
        line += f"; device memory in use {fmt_bytes(before['in_use'])} -> {fmt_bytes(backend.memory()['in_use'])}"
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


def reference_model(checkpoint: Checkpoint, dtype: torch.dtype = torch.bfloat16):
    """A plain text model on the host whose weights are the checkpoint's, dequantized here with
    compressed-tensors' own unpack (codes x scales), independent of the loading path above.

    Sized for a Colab host: only the text decoder's tensors are read (never the towers, nor the
    redundant lm_head copy), each packed weight is dequantized once, straight into ``dtype``;
    the process's peak host memory is printed. Its generation config (the stop ids) is the
    checkpoint's own, as ``from_pretrained`` would read it."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from transformers import Gemma4ForCausalLM, GenerationConfig

    folder = checkpoint.path
    config = text_config(read_config(folder))
    config.quantization_config = None
    state = {}
    with CheckpointTensors(folder) as tensors:
        for key in tensors.keys():
            name = text_key(key)
            if name is None or name == "lm_head.weight" or re.search(r"\.weight_(scale|shape|zero_point)$", name):
                continue  # towers never read; lm_head is tied to embed_tokens; quantization parameters below
            tensor = tensors.get(key)
            if name.endswith(".weight_packed"):
                stem = key[: -len("packed")]
                shape = torch.Size(tensors.get(stem + "shape").tolist())
                scale = tensors.get(stem + "scale").float()
                codes = unpack_from_int32(tensor, 4, shape).float()
                tensor = (codes.reshape(shape[0], -1, GROUP_SIZE) * scale[..., None]).reshape(shape)
                name = name[: -len("_packed")]
            state[name] = tensor.to(dtype)
    model = Gemma4ForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=dtype).eval()
    if (folder / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    peak = host_peak_bytes()
    print(
        f"reference model: {fmt_bytes(sum(t.numel() * t.element_size() for t in state.values()))} of text-decoder "
        f"weights in {dtype}; this process's peak host memory so far: {fmt_bytes(peak)}"
    )
    return model


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


def greedy_tokens(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """HF ``generate``'s greedy tokens after ``ids``: at most ``new_tokens``, up to and
    including the first stop id, as notebook 03's reference."""
    out = model.generate(ids, generation_config=greedy_config(model, new_tokens))
    return out.sequences[0, ids.shape[1] :].tolist()


def check_tokens(backend: Backend, checkpoint: Checkpoint, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """The reference model's greedy tokens, computed on the same device as the loads they
    check (bf16 rounding differs between devices), one model on the device at a time."""
    reference = reference_model(checkpoint).to(backend.device)
    tokens = greedy_tokens(reference, ids, new_tokens)
    unload(reference, backend)
    return tokens


# --- "the same tokens": one verdict for two programs that round differently ---------------------
NEAR_TIE_ULPS = 4  # two programs rounding differently move a logit by a few units in its last place


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of each of ``values`` at ``dtype``'s precision: bf16 keeps 8
    significant bits (``finfo.eps`` 2**-7), float32 24 (2**-23)."""
    exponent = torch.floor(torch.log2(values.float().abs().clamp_min(torch.finfo(torch.float32).tiny)))
    return torch.exp2(exponent) * torch.finfo(dtype).eps


@dataclasses.dataclass
class Verdict:
    """Whether a run's tokens are the reference's, and how that was decided.

    ``exact``: compared as lists, which holds only where the two runs' arithmetic is the same
    by construction (one program twice). Otherwise teacher-forced against a reference model:
    each token must be its argmax there, or within ``tolerance_ulps`` units in the last place
    of the top logit (in ``dtype``, the reference's logits') of it, a near tie.
    ``first_divergence``: the first position where the lists part (None if they do not);
    ``gap``: the reference's logit gap there (teacher-forced); ``failed_at``: the first token
    that is no near tie, or where one list ends and the other goes on with the same tokens;
    ``near_ties``: (position, gap) of every near tie met; ``largest_ulps``: the largest gap
    seen at a token that is not the argmax, in ulps (0: every token is the argmax)."""

    same: bool
    exact: bool
    first_divergence: int | None = None
    gap: float | None = None
    failed_at: int | None = None
    near_ties: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    tolerance_ulps: int = NEAR_TIE_ULPS
    failed_ulps: float | None = None  # the gap at ``failed_at``, in ulps of the top logit
    dtype: str = "bfloat16"
    largest_ulps: float = 0.0

    def __bool__(self) -> bool:
        return self.same

    def __str__(self) -> str:
        how = (
            "equal lists"
            if self.exact
            else f"teacher-forced, near ties within {self.tolerance_ulps} {self.dtype} ulps,"
            f" largest gap seen {self.largest_ulps:.1f} ulps"
        )
        parts = "never part" if self.first_divergence is None else f"first part at token {self.first_divergence}"
        if self.gap is not None and self.first_divergence is not None:
            parts += f" (reference logit gap there {self.gap:.3g})"
        ties = f", {len(self.near_ties)} near tie(s) at {[p for p, _ in self.near_ties]}" if self.near_ties else ""
        failed = ""
        if self.failed_at is not None:
            failed = (
                f", token {self.failed_at} is no near tie ({self.failed_ulps:.1f} ulps)"
                if self.failed_ulps is not None
                else f", one list ends at token {self.failed_at} where the other goes on"
            )
        return f"same tokens: {self.same} ({how}; {parts}{ties}{failed})"


def teacher_forced_gaps(model, ids: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the prompt ``ids`` [1, L] and ``tokens`` through ``model`` (no cache): at
    each generated position, the top logit less the logit of the token there (0: its argmax),
    and one unit in the last place of the top logit at the logits' dtype."""
    device = next(model.parameters()).device
    full = torch.cat([ids.cpu(), torch.tensor([tokens], dtype=ids.dtype)], dim=1).to(device)
    with torch.no_grad():  # the head on the generated positions only: a long prompt's logits are vocab-wide
        logits = model(full, use_cache=False, logits_to_keep=len(tokens) + 1).logits[0, : len(tokens)]
    dtype, logits = logits.dtype, logits.float().cpu()
    top = logits.max(-1).values
    gaps = top - logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return gaps, ulp(top, dtype)


def compare_tokens(
    tokens: list[int], reference: list[int], model=None, ids=None, tolerance_ulps: int = NEAR_TIE_ULPS
) -> Verdict:
    """The one comparison of the series. With the reference ``model`` and the prompt ``ids``:
    teacher-forced, each of ``tokens`` the model's argmax after the ones before it, or a near
    tie. Without ``model``: the lists must be equal, for two runs whose arithmetic is the same
    by construction (one program, run twice on the same inputs)."""
    parted = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    ended = None  # the same tokens, but one list stops where the other goes on: no tie explains that
    if parted is None and len(tokens) != len(reference):
        parted = ended = min(len(tokens), len(reference))
    if model is None:
        return Verdict(same=parted is None, exact=True, first_divergence=parted, tolerance_ulps=tolerance_ulps)
    gaps, ulps = teacher_forced_gaps(model, ids, tokens) if tokens else (torch.zeros(0), torch.ones(0))
    in_ulps = gaps / ulps
    ties = [(i, float(g)) for i, (g, u) in enumerate(zip(gaps, in_ulps)) if 0 < u <= tolerance_ulps]
    failed = min((i for i, u in enumerate(in_ulps) if u > tolerance_ulps), default=ended)
    failed = failed if ended is None else min(failed, ended)
    gap = float(gaps[parted]) if parted is not None and parted < len(tokens) else None
    failed_ulps = float(in_ulps[failed]) if failed is not None and failed != ended else None
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    largest = float(in_ulps.max()) if len(in_ulps) else 0.0
    return Verdict(failed is None, False, parted, gap, failed, ties, tolerance_ulps, failed_ulps, dtype, largest)


def unpack_is_exact(device) -> bool:
    """Whether compressed-tensors' own unpack returns the packed int4 codes on ``device``.

    The default load path unpacks on the device at the first forward; on PyTorch/XLA 2.9
    with compressed-tensors 0.15 this returns wrong codes (measured: about half of them):
    its unpack shifts int32 words right, and there `>>` of a negative word rounds like a
    division, off by one in every word with the top bit set.
    """
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(4, 4)
    unpacked = unpack_from_int32(pack_to_int32(codes, 4).to(device), 4, codes.shape)
    return torch.equal(unpacked.cpu(), codes)  # integer codes: right or wrong, no rounding
