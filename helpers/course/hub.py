"""Which checkpoint, and getting it: Google's public repository through the Hugging Face Hub
(anonymous first, a token only where the Hub says a repository is gated; outages, the cache),
a local folder, or the tiny offline twin."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from ..backend import Backend
from ..checkpoint import Checkpoint, CheckpointError
from .e2b import CONTEXT, estimate_device_bytes, fit_options, real_config
from .synthetic import SYNTHETIC, build_synthetic_e2b
from .tables import fmt_bytes
from .twin import build_tiny_twin

REPO_ID = "google/gemma-4-E2B-it-qat-w4a16-ct"
# The QAT training's own weights, bf16 on the 4-bit grid (the -ct export re-rounded its linears):
# the same shapes and loader, one switch away (HELPERS_MODEL).
QAT_REPO_ID = "google/gemma-4-E2B-it-qat-q4_0-unquantized"
MODEL_VAR = "HELPERS_MODEL"  # a repo id, a local folder, "tiny", or "e2b-synthetic"
REVISION_VAR = "HELPERS_REVISION"


def hf_token() -> str | None:
    """The Hugging Face token as huggingface_hub finds it: ``$HF_TOKEN``, a token stored by
    ``huggingface_hub.login()``, or Colab's secret ``HF_TOKEN``."""
    from huggingface_hub import get_token

    return get_token()


_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]  # the chat template is chat_template.jinja


def _hub_access(repo_id: str) -> tuple[str | bool, str | None]:
    """How to read ``repo_id`` from the Hub: ``(False, None)`` anonymously (the course's
    repositories are public and ungated), ``(token, None)`` where the Hub says the repository is
    gated and the token may read it, or ``(False, why)`` when the Hub cannot be asked (offline, a
    network error, an outage). A clear error when the Hub says no. The token is looked up only
    for a gated repository: in Colab that lookup may ask to share the secret."""
    from huggingface_hub import auth_check
    from huggingface_hub.errors import GatedRepoError, HTTPError, RepositoryNotFoundError

    token: str | bool = False  # False: huggingface_hub sends no token, not even a stored one
    try:
        try:
            auth_check(repo_id, token=False)
            return False, None
        except GatedRepoError:
            token = hf_token()
            if token is None:
                raise CheckpointError(
                    f"the Hub says {repo_id} is gated, so it needs a Hugging Face token with its licence accepted: "
                    f"accept it at https://huggingface.co/{repo_id}, then run huggingface_hub.login(), set HF_TOKEN, "
                    f"or in Colab add the secret HF_TOKEN (the key icon, notebook access on), and rerun; or continue "
                    f"on the tiny twin with os.environ['{MODEL_VAR}'] = 'tiny'."
                ) from None
            auth_check(repo_id, token=token)
            return token, None
    except GatedRepoError:
        raise CheckpointError(
            f"the Hugging Face token has no access to {repo_id}, which the Hub says is gated: accept its licence at "
            f"https://huggingface.co/{repo_id} with the token's account, then rerun; or continue on the tiny "
            f"twin with os.environ['{MODEL_VAR}'] = 'tiny'."
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such repository, or it is private to another account.") from None
    except (OSError, HTTPError) as err:  # offline mode, connection errors, 5xx answers
        return token, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no answer'}"


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError:
        return None


def real_model_fits(backend: Backend) -> tuple[bool, str]:
    """Whether E2B's text decoder fits this device's free memory once it has run a forward (the
    preflight's estimate, ``e2b.estimate_device_bytes``, from the real configuration), and the
    numbers, for the printed reason."""
    needed, free = estimate_device_bytes(real_config(), dequantize=False), backend.free_bytes()
    if free is None:
        return False, f"E2B needs ~{needed / 1e9:.1f} GB and {backend.name} does not report its free memory"
    return needed <= free, f"E2B needs ~{needed / 1e9:.1f} GB, {free / 1e9:.1f} GB free"


def choose_checkpoint(backend: Backend, fetch_it: bool = True) -> Checkpoint:
    """The real checkpoint on a TPU, and on a CUDA GPU where it fits (a Colab T4 or L4 when there
    is no TPU quota), else the tiny twin; ``$HELPERS_MODEL`` decides if set (a repo id, a local
    folder, or ``tiny``). When the Hub cannot be reached, the cached snapshot if there is one,
    else the twin, with the reason in the printed line. Resolved once, here: what is chosen is
    fetched (``fetch``), and everything after reads its local folder (``Checkpoint.path``);
    ``fetch_it=False`` only decides."""
    chosen = _choose(backend)
    return fetch(chosen) if fetch_it else chosen


def _choose(backend: Backend) -> Checkpoint:
    asked, revision = os.environ.get(MODEL_VAR), os.environ.get(REVISION_VAR)
    if asked == "tiny":
        return Checkpoint(str(build_tiny_twin()), None, True, f"{MODEL_VAR}=tiny")
    if asked == SYNTHETIC:  # E2B's size, format and bf16, random weights: for bytes, times and programs
        return Checkpoint(
            str(build_synthetic_e2b()), None, False, f"{MODEL_VAR}={SYNTHETIC}, built in the cache", synthetic=True
        )
    if asked:
        return Checkpoint(asked, revision, False, f"{MODEL_VAR} is set")
    if backend.default_model == "twin":
        return Checkpoint(str(build_tiny_twin()), None, True, f"no TPU or GPU here (backend {backend.name})")
    where = "a TPU"
    if backend.default_model == "e2b if it fits":
        fits, numbers = real_model_fits(backend)
        if not fits:
            return Checkpoint(str(build_tiny_twin()), None, True, f"a GPU too small for E2B ({numbers})")
        where = f"a GPU where E2B fits ({numbers})"
    token, unreachable = _hub_access(REPO_ID)
    if unreachable is None:
        return Checkpoint(
            REPO_ID, revision, False, f"{where}, and the Hub " + ("with your token" if token else "(public)")
        )
    cached = _cached_snapshot(REPO_ID, revision)
    if cached:
        return Checkpoint(
            REPO_ID, revision, False, f"the Hub is unreachable ({unreachable}): its cached snapshot", cached
        )
    return Checkpoint(
        str(build_tiny_twin()), None, True, f"the Hub is unreachable ({unreachable}) and nothing is cached"
    )


def fetch(checkpoint: Checkpoint) -> Checkpoint:
    """``checkpoint`` with its local folder: as it is when it has one (a folder, the Hub's cache),
    else a copy whose ``folder`` is the download, made only after access was checked."""
    if checkpoint.folder or pathlib.Path(checkpoint.source).is_dir():
        return checkpoint
    from huggingface_hub import snapshot_download

    token, unreachable = _hub_access(checkpoint.source)
    if unreachable:
        raise CheckpointError(f"cannot reach the Hub for {checkpoint.source} ({unreachable}) and it is not cached.")
    folder = snapshot_download(checkpoint.source, revision=checkpoint.revision, token=token, allow_patterns=_PATTERNS)
    return dataclasses.replace(checkpoint, folder=str(folder))


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
