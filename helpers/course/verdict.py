"""The series' one verdict on "the same tokens", and the reference it judges against: a plain
model dequantized independently of the loading path, and HF ``generate``'s greedy tokens."""

import dataclasses
import re

import torch

from ..backend import Backend
from ..checkpoint import read_config, text_config, unload
from ..generate import greedy_config
from ..packed import GROUP_SIZE, CheckpointTensors, text_key
from ..timing import host_peak_bytes
from .hub import Checkpoint
from .report import fmt_bytes


def reference_model(checkpoint: Checkpoint, dtype: torch.dtype = torch.bfloat16):
    """A plain text model on the host, dequantized with compressed-tensors' own unpack, independent
    of the loading path. Sized for a Colab host: text decoder tensors only, each dequantized once."""
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
                groups = unpack_from_int32(tensor, 4, shape).float().reshape(shape[0], -1, GROUP_SIZE)
                tensor = (groups * tensors.get(stem + "scale").float()[..., None]).reshape(shape)
                name = name[: -len("_packed")]
            state[name] = tensor.to(dtype)
    model = Gemma4ForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=dtype).eval()
    if (folder / "generation_config.json").exists():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    print(
        f"reference model: {fmt_bytes(sum(t.numel() * t.element_size() for t in state.values()))} of text-decoder "
        f"weights in {dtype}; this process's peak host memory so far: {fmt_bytes(host_peak_bytes())}"
    )
    return model


def greedy_tokens(model, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """HF ``generate``'s greedy tokens after ``ids`` (at most ``new_tokens``, through the first stop id)."""
    out = model.generate(ids, generation_config=greedy_config(model, new_tokens))
    return out.sequences[0, ids.shape[1] :].tolist()


def check_tokens(backend: Backend, checkpoint: Checkpoint, ids: torch.Tensor, new_tokens: int) -> list[int]:
    """The reference model's greedy tokens on the device of the loads they check: bf16 rounds differently per device."""
    reference = reference_model(checkpoint).to(backend.device)
    tokens = greedy_tokens(reference, ids, new_tokens)
    unload(reference, backend)
    return tokens


# --- "the same tokens": one verdict for two programs that round differently ---------------------
NEAR_TIE_ULPS = 4  # two programs rounding differently move a logit by a few units in its last place


def ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of each of ``values`` at ``dtype`` (bf16: 2**-7 relative; float32: 2**-23)."""
    exponent = torch.floor(torch.log2(values.float().abs().clamp_min(torch.finfo(torch.float32).tiny)))
    return torch.exp2(exponent) * torch.finfo(dtype).eps


@dataclasses.dataclass
class Verdict:
    """Whether a run's tokens are the reference's: ``exact`` lists, else teacher-forced, each token the argmax or within
    ``tolerance_ulps`` ulps of it; ``failed_at``: the first that is neither."""

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
        forced = f"teacher-forced, near ties within {self.tolerance_ulps} {self.dtype} ulps"
        how = "equal lists" if self.exact else f"{forced}, largest gap seen {self.largest_ulps:.1f} ulps"
        parts = "never part" if self.first_divergence is None else f"first part at token {self.first_divergence}"
        if self.gap is not None and self.first_divergence is not None:
            parts += f" (reference logit gap there {self.gap:.3g})"
        ties = f", {len(self.near_ties)} near tie(s) at {[p for p, _ in self.near_ties]}" if self.near_ties else ""
        failed = "" if self.failed_at is None else f", one list ends at token {self.failed_at} where the other goes on"
        if self.failed_at is not None and self.failed_ulps is not None:
            failed = f", token {self.failed_at} is no near tie ({self.failed_ulps:.1f} ulps)"
        return f"same tokens: {self.same} ({how}; {parts}{ties}{failed})"


def teacher_forced_gaps(model, ids: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One uncached forward of ``ids`` [1, L] and ``tokens``: per generated position, the top logit less
    the token's (0: its argmax), and the top logit's ulp at the logits' dtype."""
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
    """The series' one comparison: teacher-forced against ``model`` on prompt ``ids``; without
    ``model`` the lists must be equal (for one program run twice on the same inputs)."""
    parted = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    ended = None  # the same tokens, but one list stops where the other goes on: no tie explains that
    if parted is None and len(tokens) != len(reference):
        parted = ended = min(len(tokens), len(reference))
    if model is None:
        return Verdict(same=parted is None, exact=True, first_divergence=parted, tolerance_ulps=tolerance_ulps)
    gaps, ulps = teacher_forced_gaps(model, ids, tokens) if tokens else (torch.zeros(0), torch.ones(0))
    in_ulps = gaps / ulps
    ties = [(i, float(g)) for i, (g, u) in enumerate(zip(gaps, in_ulps)) if 0 < u <= tolerance_ulps]
    failed = next((i for i, u in enumerate(in_ulps[:ended]) if u > tolerance_ulps), ended)
    gap = float(gaps[parted]) if parted is not None and parted < len(tokens) else None
    failed_ulps = float(in_ulps[failed]) if failed is not None and failed != ended else None
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    largest = float(in_ulps.max()) if len(in_ulps) else 0.0
    return Verdict(failed is None, False, parted, gap, failed, ties, tolerance_ulps, failed_ulps, dtype, largest)


def unpack_is_exact(device) -> bool:
    """Whether compressed-tensors' own unpack gives the packed codes on ``device``: on PyTorch/XLA 2.9 it does not
    (``>>`` of a negative int32 rounds like a division)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(4, 4)
    unpacked = unpack_from_int32(pack_to_int32(codes, 4).to(device), 4, codes.shape)
    return torch.equal(unpacked.cpu(), codes)  # integer codes: right or wrong, no rounding
