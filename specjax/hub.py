"""Hugging Face Hub repo ids for targets, drafts and checkpoints.

A repo id (``org/name``) is looked up in the local HF cache (``HF_HOME`` / ``HF_HUB_CACHE``,
``huggingface_hub.snapshot_download(local_files_only=True)``): that never touches the network.
Only an explicit opt-in downloads: ``download=True`` (the CLI's ``--download``) or the
environment variable ``SPECJAX_ALLOW_DOWNLOAD=1``. A download fetches the files a model or draft
checkpoint is made of (:data:`ALLOW_PATTERNS`: configs, safetensors, tokenizer and chat-template
files; not ``original/`` PyTorch weights) into the same cache, so later runs find it offline.

Without the opt-in, or offline (``HF_HUB_OFFLINE=1``), a repo id that is not cached is a
:class:`NotCachedError` / :class:`DownloadError` whose message names the repo id and the
command that fetches it (``hf download <id>``, or the same command with ``--download``).
"""

from __future__ import annotations

import os
from pathlib import Path

from bridge.errors import BridgeError

ENV_ALLOW = "SPECJAX_ALLOW_DOWNLOAD"
_TRUE = ("1", "true", "yes", "on")
#: what a download fetches: everything a target/draft directory is read from (specjax reads
#: safetensors, never .bin/.pth/.gguf from a repo)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "additional_chat_templates/*"]
IGNORE_PATTERNS = ["original/*"]


class HubError(BridgeError):
    """A repo id that cannot be resolved to a local directory."""


class NotCachedError(HubError, LookupError):
    """The repo id is not in the local HF cache and downloading was not allowed."""

    def __init__(self, message: str, *, repo_id: str, hint: str):
        self.repo_id, self.hint = repo_id, hint
        super().__init__(message)


class DownloadError(HubError):
    """Downloading was allowed but failed: offline mode, no route to the Hub, or a repo the Hub refuses."""


def download_allowed(download: bool | None = None) -> bool:
    """``download`` when given, else whether ``SPECJAX_ALLOW_DOWNLOAD`` is set to a true value."""
    if download is not None:
        return bool(download)
    return os.environ.get(ENV_ALLOW, "").strip().lower() in _TRUE


def offline() -> bool:
    """huggingface_hub's offline mode (``HF_HUB_OFFLINE``; read now, not only at its import)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def is_repo_id(spec: str | os.PathLike | None) -> bool:
    """Whether ``spec`` is a syntactically valid Hub repo id (``name`` or ``org/name``) that is not
    an existing local path."""
    if spec is None:
        return False
    s = os.fspath(spec)
    if not s or Path(s).expanduser().exists() or s.startswith((".", "/", "~")) or s.count("/") > 1:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(s)
    except HFValidationError:
        return False
    return True


def cached(repo_id: str) -> Path | None:
    """The snapshot directory of ``repo_id`` in the local HF cache (its ``refs/main``), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None


def fetch_hint(repo_id: str, *, flag: bool = True) -> str:
    """How to get ``repo_id`` into the cache: the exact commands."""
    rerun = "rerun with --download (or SPECJAX_ALLOW_DOWNLOAD=1)" if flag else f"rerun with {ENV_ALLOW}=1"
    return f"{rerun} on a machine that reaches the Hub, or fetch it first with `hf download {repo_id}`"


def fetch(repo_id: str, *, kind: str = "checkpoint") -> Path:
    """Download ``repo_id`` (:data:`ALLOW_PATTERNS`) into the HF cache; the snapshot directory."""
    from huggingface_hub import snapshot_download

    if offline():
        snap = cached(repo_id)
        if snap is not None:
            return snap
        raise DownloadError(f"cannot download {kind} {repo_id!r}: huggingface_hub is in offline mode "
                            f"(HF_HUB_OFFLINE=1) and the repo is not in the local HF cache ({cache_dir()}); "
                            f"unset HF_HUB_OFFLINE on a machine that reaches the Hub and rerun with --download, or "
                            f"fetch it there with `hf download {repo_id}` and copy its HF cache here")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS))
    except Exception as e:  # noqa: BLE001 - any failure of the Hub client becomes one typed message
        snap = cached(repo_id)
        if snap is not None:  # no route to the Hub, but an earlier download is there
            return snap
        from huggingface_hub import constants
        from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

        cause = e.__cause__ or e
        detail = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        if isinstance(e, GatedRepoError):
            why = "the repo is gated: accept its terms on the Hub and log in (`hf auth login`)"
        elif isinstance(e, RepositoryNotFoundError):
            why = "the Hub has no such repo (or it is private: log in with `hf auth login`)"
        elif isinstance(e, LocalEntryNotFoundError):  # online mode, but the Hub did not answer
            why = f"the Hub at {constants.ENDPOINT} is unreachable ({detail})"
        else:
            why = detail
        raise DownloadError(f"cannot download {kind} {repo_id!r} from the Hub: {why}; on a machine that reaches "
                            f"it, `hf download {repo_id}` fetches it into the HF cache") from None


def resolve(spec: str | os.PathLike, *, kind: str = "checkpoint", download: bool | None = None,
            flag: bool = True) -> Path:
    """A local directory for ``spec``: an existing path as is; a repo id from the HF cache, or
    downloaded when :func:`download_allowed`. ``kind`` (target / draft / checkpoint / verifier)
    and ``flag`` (whether the caller has a ``--download`` option) word the error."""
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if p.exists() or not is_repo_id(s):
        return p
    if download_allowed(download):
        return fetch(s, kind=kind)
    snap = cached(s)
    if snap is not None:
        return snap
    hint = fetch_hint(s, flag=flag)
    raise NotCachedError(f"{kind} {s!r} is neither a local path nor a repo id in the local HF cache ({cache_dir()}); "
                         f"nothing is downloaded without an explicit opt-in: {hint}", repo_id=s, hint=hint)
