"""Which checkpoint, and getting it: Google's gated repository through the Hugging Face Hub
(token, licence, outages, the cache), a local folder, or the tiny offline twin."""

from __future__ import annotations

import dataclasses
import os
import pathlib

from .backend import Backend
from .twin import build_tiny_twin

REPO_ID = "google/gemma-4-E2B-it-qat-w4a16-ct"
MODEL_VAR = "HELPERS_MODEL"  # a repo id, a local folder, or "tiny"
REVISION_VAR = "HELPERS_REVISION"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used as asked; the message says what to do."""


@dataclasses.dataclass
class Checkpoint:
    """Where the weights come from, and why: printed first, so a reader knows what ran."""

    source: str  # a repo id or a local folder
    revision: str | None
    tiny: bool
    reason: str
    folder: str | None = None  # a local snapshot of ``source`` already at hand (the Hub's cache)

    @property
    def name(self) -> str:
        """A stable name for the weights: the repo id and revision, or the twin's folder name."""
        return pathlib.Path(self.source).name if self.tiny else f"{self.source}@{self.revision or 'main'}"

    def __str__(self) -> str:
        rev = f" @ {self.revision}" if self.revision else ""
        kind = "tiny offline twin" if self.tiny else "real checkpoint"
        return f"{kind}: {self.source}{rev} ({self.reason})"


def hf_token() -> str | None:
    """The Hugging Face token as huggingface_hub finds it: ``$HF_TOKEN``, a token stored by
    ``huggingface_hub.login()``, or Colab's secret ``HF_TOKEN``."""
    from huggingface_hub import get_token

    return get_token()


_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]  # the chat template is chat_template.jinja


def _hub_unreachable(repo_id: str, token: str) -> str | None:
    """Why the Hub cannot say whether ``token`` may read ``repo_id`` (offline, a network error,
    an outage), or None when it says yes; a clear error when it says no."""
    from huggingface_hub import auth_check
    from huggingface_hub.errors import GatedRepoError, HTTPError, RepositoryNotFoundError

    try:
        auth_check(repo_id, token=token)
    except GatedRepoError:
        raise CheckpointError(
            f"the Hugging Face token has no access to {repo_id}: accept the Gemma licence at "
            f"https://huggingface.co/{repo_id} with the token's account, then rerun; or continue on the tiny "
            f"twin with os.environ['{MODEL_VAR}'] = 'tiny'."
        ) from None
    except RepositoryNotFoundError:
        raise CheckpointError(f"{repo_id}: no such repository, or the token cannot see it.") from None
    except (OSError, HTTPError) as err:  # offline mode, connection errors, 5xx answers
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else 'no answer'}"
    return None


def _cached_snapshot(repo_id: str, revision: str | None) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=_PATTERNS, local_files_only=True)
    except LocalEntryNotFoundError:
        return None


def choose_checkpoint(backend: Backend) -> Checkpoint:
    """The real checkpoint on a TPU with a token, else the tiny twin; ``$HELPERS_MODEL`` decides
    if set (a repo id, a local folder, or ``tiny``). When the Hub cannot be reached, the cached
    snapshot if there is one, else the twin, with the reason in the printed line."""
    asked, revision = os.environ.get(MODEL_VAR), os.environ.get(REVISION_VAR)
    if asked == "tiny":
        return Checkpoint(str(build_tiny_twin()), None, True, f"{MODEL_VAR}=tiny")
    if asked:
        return Checkpoint(asked, revision, False, f"{MODEL_VAR} is set")
    if backend.name != "tpu":
        return Checkpoint(str(build_tiny_twin()), None, True, f"no TPU here (backend {backend.name})")
    token = hf_token()
    if token is None:
        return Checkpoint(
            str(build_tiny_twin()),
            None,
            True,
            "no Hugging Face token: huggingface_hub.login(), HF_TOKEN, or the Colab secret HF_TOKEN",
        )
    unreachable = _hub_unreachable(REPO_ID, token)
    if unreachable is None:
        return Checkpoint(REPO_ID, revision, False, "TPU and a Hugging Face token")
    cached = _cached_snapshot(REPO_ID, revision)
    if cached:
        return Checkpoint(
            REPO_ID, revision, False, f"the Hub is unreachable ({unreachable}): its cached snapshot", cached
        )
    return Checkpoint(
        str(build_tiny_twin()), None, True, f"the Hub is unreachable ({unreachable}) and nothing is cached"
    )


def local_folder(checkpoint: Checkpoint) -> pathlib.Path:
    """A local folder holding the checkpoint: downloaded only after access was checked."""
    if checkpoint.folder:
        return pathlib.Path(checkpoint.folder)
    folder = pathlib.Path(checkpoint.source)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    token = hf_token()
    if token is None:
        raise CheckpointError(
            f"{checkpoint.source} is gated and no Hugging Face token was found: run "
            "huggingface_hub.login(), set HF_TOKEN, or in Colab add the secret HF_TOKEN "
            "(the key icon, notebook access on)."
        )
    unreachable = _hub_unreachable(checkpoint.source, token)
    if unreachable:
        raise CheckpointError(f"cannot reach the Hub for {checkpoint.source} ({unreachable}) and it is not cached.")
    return pathlib.Path(
        snapshot_download(checkpoint.source, revision=checkpoint.revision, token=token, allow_patterns=_PATTERNS)
    )
