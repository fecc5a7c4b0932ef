"""Hugging Face Hub downloads: the files mlx-lm needs, from the HF cache when possible.

Offline mode and the cache location are read from the environment at call time (not at
import, as huggingface_hub does), so `HF_HUB_OFFLINE=1 mlx-spec ...` and tests that point
`HF_HUB_CACHE` at a fake cache behave as the user expects.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path

from mlx_spec.errors import ModelLoadError

# What mlx-lm reads from a model repo: config, tokenizer files and safetensors weights.
ALLOW_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_TRUTHY = {"1", "true", "yes", "on"}


def looks_like_repo_id(source: str) -> bool:
    """True for "org/name" strings (the form of a Hub model id)."""
    return bool(_REPO_ID.match(source)) and ".." not in source and not source.endswith(".gguf")


def offline() -> bool:
    """Whether HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) forbids network access."""
    return any(os.environ.get(name, "").strip().lower() in _TRUTHY
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


_forced = False  # offline because the command chose so, not the user (see forced_offline)


@contextmanager
def forced_offline():
    """Within the block, Hub models resolve from the HF cache only (no network); an error
    then says the command does not download, not that the user set HF_HUB_OFFLINE."""
    global _forced
    saved, was_forced = os.environ.get("HF_HUB_OFFLINE"), _forced
    _forced = not offline()
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        _forced = was_forced
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved


def hub_cache_dir() -> Path:
    """HF_HUB_CACHE, else $HF_HOME/hub, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def download(repo_id: str, *, progress: bool = True) -> Path:
    """The local snapshot folder of `repo_id`, downloading what is missing.

    Args:
        repo_id: a Hub model id such as "mlx-community/gemma-3-270m-it-4bit".
        progress: show download progress bars.
    Returns:
        The snapshot folder (inside the HF cache).
    Raises:
        ModelLoadError: offline and not cached, unknown or gated repo, or no network.
    """
    from huggingface_hub import errors, snapshot_download

    is_offline = offline()
    cache = hub_cache_dir()
    tried = f"'{repo_id}' is not a local path"
    try:
        folder = snapshot_download(
            repo_id,
            allow_patterns=ALLOW_PATTERNS,
            cache_dir=cache,
            local_files_only=is_offline,
            tqdm_class=None if progress else _silent_tqdm(),
        )
    except errors.GatedRepoError:
        raise ModelLoadError(f"{tried}, and Hub repo '{repo_id}' is gated: accept its licence "
                             "on huggingface.co and log in with `hf auth login`") from None
    except errors.RepositoryNotFoundError:
        raise ModelLoadError(f"{tried}, and the Hugging Face Hub has no model '{repo_id}' "
                             "(or it is private: log in with `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise ModelLoadError(f"{tried}, and Hub repo '{repo_id}' has no 'main' revision") from None
    except errors.IncompleteSnapshotError:
        raise ModelLoadError(f"{tried}, and its copy in the HF cache ({cache}) is incomplete; "
                             "download it again with network access") from None
    except errors.LocalEntryNotFoundError:
        if is_offline:
            why = "; this command does not download" if _forced else " while HF_HUB_OFFLINE is set"
            raise ModelLoadError(f"{tried}, and Hub model '{repo_id}' is not in the HF cache "
                                 f"({cache}){why}") from None
        raise ModelLoadError(f"{tried}, and the Hugging Face Hub could not be reached to "
                             f"download '{repo_id}' (not in the HF cache {cache} either)") from None
    except errors.HFValidationError:
        raise ModelLoadError(f"{tried}, and not a valid Hugging Face repo id") from None
    except errors.HfHubHTTPError as error:
        reason = str(error).splitlines()[0]
        raise ModelLoadError(f"downloading '{repo_id}' from the Hub failed: {reason}") from None
    except OSError as error:  # disk full, permissions
        raise ModelLoadError(f"downloading '{repo_id}' failed: {error}") from None
    return Path(folder)


def _silent_tqdm():
    from huggingface_hub.utils import tqdm

    class Silent(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def cached_models() -> list[tuple[str, Path, int]]:
    """(repo id, snapshot folder, bytes on disk) for each model repo in the HF cache: the
    snapshot `main` points to, else the newest one. Empty when there is no cache."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(hub_cache_dir())
    except CacheNotFound:
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = next((r for r in repo.revisions if "main" in r.refs),
                        max(repo.revisions, key=lambda r: r.last_modified))
        found.append((repo.repo_id, Path(revision.snapshot_path), int(repo.size_on_disk)))
    return found
