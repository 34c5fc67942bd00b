"""Which checkpoint, and getting it: Google's repository through the Hugging Face Hub (anonymous,
a token only for a gated one; outages, the cache), a local folder, or the tiny offline twin."""

import dataclasses
import os
import pathlib

import torch

from ..backend import Backend
from ..checkpoint import CheckpointError
from .e2b import CONTEXT, estimate_device_bytes, fit_options, real_config
from .offline import SYNTHETIC, build_synthetic_assistant, build_synthetic_e2b, build_tiny_twin, build_twin_assistant
from .report import fmt_bytes

REPO_ID = "google/gemma-4-E2B-it-qat-w4a16-ct"
# The QAT training's own bf16 weights on the 4-bit grid (the -ct export re-rounded its linears).
QAT_REPO_ID = "google/gemma-4-E2B-it-qat-q4_0-unquantized"
ASSISTANT_REPO_ID = "google/gemma-4-E2B-it-assistant"  # its drafter (notebook 09)
MODEL_VAR = "HELPERS_MODEL"  # a repo id, a local folder, "tiny", or "e2b-synthetic"
REVISION_VAR = "HELPERS_REVISION"
_OR_TWIN = f"or continue on the tiny twin with os.environ['{MODEL_VAR}'] = 'tiny'."  # the way on without a token


def describe(backend: Backend) -> str:
    """One line a reader can trust: backend, device and its memory."""
    parts = [f"backend {backend.name}", f"device {backend.device}"]
    if backend.device.type == "cuda":
        parts.append(torch.cuda.get_device_name(backend.device))
    if total := (backend.memory() or {}).get("total"):
        parts.append(f"{total / 2**30:.1f} GiB device memory")
    if backend.lazy:
        parts.append(f"PJRT_DEVICE={os.environ['PJRT_DEVICE']}")
    parts.append(f"{torch.get_num_threads()} CPU threads")  # what the host's ops run on (a reader's default)
    return ", ".join(parts)


def default_model(backend: Backend) -> str:
    """What the series loads unless told: E2B on a TPU, on a CUDA GPU if it fits (a Colab T4 or L4), else the twin."""
    return "e2b" if backend.on_tpu else "e2b if it fits" if backend.device.type == "cuda" else "twin"


@dataclasses.dataclass
class Checkpoint:
    """Where the weights come from, and why: printed first, so a reader knows what ran."""

    source: str  # a repo id or a local folder
    revision: str | None
    tiny: bool
    reason: str
    folder: str | None = None  # where ``source`` was fetched to once (a download, or the Hub's cache)
    synthetic: bool = False  # E2B's layout with random weights (``helpers.course.offline``)

    @property
    def name(self) -> str:
        """A stable name for the weights: the repo id and revision, or the twin's folder name."""
        return pathlib.Path(self.source).name if self.tiny else f"{self.source}@{self.revision or 'main'}"

    @property
    def path(self) -> pathlib.Path:
        """The folder read: ``folder`` (fetched by ``helpers.choose_checkpoint``) or ``source``; never the Hub."""
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
        home = str(pathlib.Path.home())  # no machine's paths in what is printed and committed
        source = "~" + str(self.source)[len(home) :] if str(self.source).startswith(home + "/") else self.source
        return f"{kind}: {source}{rev} ({self.reason})"


def series_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """bf16 for the real model; float32 for the twin, whose close logits on unlearned prompts bf16 would round
    differently per program (measured on xla: parted at token 4)."""
    return torch.float32 if checkpoint.tiny else torch.bfloat16


def hf_token() -> str | None:
    """``$HF_TOKEN``, the token ``huggingface_hub.login()`` stored, or Colab's secret ``HF_TOKEN``."""
    from huggingface_hub import get_token

    return get_token()


_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]  # the chat template is chat_template.jinja


def _hub_access(repo_id: str) -> tuple[str | bool, str | None]:
    """How to read ``repo_id``: ``(False, None)`` anonymously, ``(token, None)`` if gated and the
    token may read it, ``(False, why)`` if the Hub cannot be asked; a clear error if it says no.
    The token is looked up only when gated: in Colab that may ask to share the secret."""
    from huggingface_hub import auth_check
    from huggingface_hub.errors import GatedRepoError, HTTPError, RepositoryNotFoundError

    token: str | bool = False  # False: huggingface_hub sends no token, not even a stored one
    try:
        try:
            auth_check(repo_id, token=False)
        except GatedRepoError:
            token = hf_token()
            if token is None:
                raise CheckpointError(
                    f"the Hub says {repo_id} is gated, so it needs a Hugging Face token with its licence accepted: "
                    f"accept it at https://huggingface.co/{repo_id}, then run huggingface_hub.login(), set HF_TOKEN, "
                    f"or in Colab add the secret HF_TOKEN (the key icon, notebook access on), and rerun; {_OR_TWIN}"
                ) from None
            auth_check(repo_id, token=token)
        return token, None
    except GatedRepoError:
        raise CheckpointError(
            f"the Hugging Face token has no access to {repo_id}, which the Hub says is gated: accept its licence at "
            f"https://huggingface.co/{repo_id} with the token's account, then rerun; {_OR_TWIN}"
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such repository, or it is private to another account.") from None
    except (OSError, HTTPError) as err:  # offline mode, connection errors, 5xx answers
        return token, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no answer'}"


def free_bytes(backend: Backend) -> int | None:
    """Free device memory; available host RAM on a CPU; None where unknown."""
    memory = backend.memory()
    if memory and memory["total"] is not None:
        return memory["total"] - memory["in_use"]
    if backend.device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return None


def real_model_fits(backend: Backend) -> tuple[bool, str]:
    """Whether E2B's text decoder fits the free memory after a forward (``e2b.estimate_device_bytes``),
    and the numbers for the printed reason."""
    needed, free = estimate_device_bytes(real_config(), dequantize=False), free_bytes(backend)
    if free is None:
        return False, f"E2B needs ~{needed / 1e9:.1f} GB and {backend.name} does not report its free memory"
    return needed <= free, f"E2B needs ~{needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free"


def choose_checkpoint(backend: Backend, fetch_it: bool = True) -> Checkpoint:
    """The real checkpoint on a TPU or a CUDA GPU where it fits (a Colab T4 or L4), else the twin;
    ``$HELPERS_MODEL`` overrides; the cached snapshot if the Hub is unreachable. Fetched once here."""
    chosen = _choose(backend)
    return fetch(chosen) if fetch_it else chosen


def _choose(backend: Backend) -> Checkpoint:
    asked, revision = os.environ.get(MODEL_VAR), os.environ.get(REVISION_VAR)
    if asked == "tiny":
        return Checkpoint(str(build_tiny_twin()), None, True, f"{MODEL_VAR}=tiny")
    if asked == SYNTHETIC:  # E2B's size, format and bf16, random weights: for bytes, times and programs
        reason = f"{MODEL_VAR}={SYNTHETIC}, built in the cache"
        return Checkpoint(str(build_synthetic_e2b()), None, False, reason, synthetic=True)
    if asked:
        return Checkpoint(asked, revision, False, f"{MODEL_VAR} is set")
    if default_model(backend) == "twin":
        return Checkpoint(str(build_tiny_twin()), None, True, f"no TPU or GPU here (backend {backend.name})")
    where = "a TPU"
    if default_model(backend) == "e2b if it fits":
        fits, numbers = real_model_fits(backend)
        if not fits:
            return Checkpoint(str(build_tiny_twin()), None, True, f"a GPU too small for E2B ({numbers})")
        where = f"a GPU where E2B fits ({numbers})"
    token, unreachable = _hub_access(REPO_ID)
    if unreachable is None:
        how = "with your token" if token else "(public)"
        return Checkpoint(REPO_ID, revision, False, f"{where}, and the Hub {how}")
    from huggingface_hub import snapshot_download  # the Hub is down: its cache, if any
    from huggingface_hub.errors import LocalEntryNotFoundError

    down = f"the Hub is unreachable ({unreachable})"
    try:
        cached = snapshot_download(REPO_ID, revision=revision, allow_patterns=_PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError:
        return Checkpoint(str(build_tiny_twin()), None, True, f"{down} and nothing is cached")
    return Checkpoint(REPO_ID, revision, False, f"{down}: its cached snapshot", cached)


def fetch(checkpoint: Checkpoint) -> Checkpoint:
    """``checkpoint`` with a local folder: as it is if it has one, else downloaded after an access check."""
    if checkpoint.folder or pathlib.Path(checkpoint.source).is_dir():
        return checkpoint
    from huggingface_hub import snapshot_download

    token, unreachable = _hub_access(checkpoint.source)
    if unreachable:
        raise CheckpointError(f"cannot reach the Hub for {checkpoint.source} ({unreachable}) and it is not cached.")
    folder = snapshot_download(checkpoint.source, revision=checkpoint.revision, token=token, allow_patterns=_PATTERNS)
    return dataclasses.replace(checkpoint, folder=str(folder))


def choose_assistant(checkpoint: Checkpoint) -> pathlib.Path:
    """The folder of ``checkpoint``'s assistant: the twin's (trained offline, cached), the synthetic checkpoint's
    (random, E2B's widths), or Google's, fetched once."""
    if checkpoint.tiny:
        return build_twin_assistant(checkpoint.path)
    if checkpoint.synthetic:
        return build_synthetic_assistant(checkpoint.path)
    return fetch(Checkpoint(ASSISTANT_REPO_ID, None, False, "Google's assistant for E2B")).path


def preflight(
    config, backend: Backend, dequantize: bool, available: int | None = None, where: str | None = None
) -> str:
    """Refuse a load that will not fit, saying what to change; ``available`` and ``where``: a what-if."""
    needed = estimate_device_bytes(config, dequantize)
    available = free_bytes(backend) if available is None else available
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
