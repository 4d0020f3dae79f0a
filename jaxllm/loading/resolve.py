"""A model's name -> the local files the loaders read, in one function every entry point calls.

Names, in the order they are tried:
- nothing: the embedded SmolLM2 GGUF;
- a path that exists: a Hugging Face folder, a GGUF file or a jaxllm orbax checkpoint, as it is;
- ``org/name``: a Hugging Face hub repository, fetched into huggingface_hub's cache (only what the loaders read:
  configs, tokenizer files, chat templates, safetensors weights; not the .bin / .pth / ONNX / GGUF duplicates);
- ``org/name:QUANT``: the GGUF file of a repository whose name carries that quantization tag (llama.cpp's
  convention: ``:Q4_K_M`` picks ``*Q4_K_M*.gguf``, case-insensitively; split files ``-00001-of-0000N`` count once).

huggingface_hub does the fetching: its cache (``HF_HOME``, ``HF_HUB_CACHE``, or ``download_dir``), its endpoint
(``HF_ENDPOINT``), its token (``HF_TOKEN``), its offline mode (``HF_HUB_OFFLINE``: a warm cache still resolves),
its progress bars. Every failure is a `LoadError` of one line naming the model and why. The loaders never see a
hub id.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

from jaxllm.loading.embedded import EMBEDDED_NAME, embedded_model_path
from jaxllm.loading.errors import LoadError

logger = logging.getLogger("jaxllm.loading")

# What the loaders read from a repository (folder layout as the hub has it).
HF_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt", "1_Pooling/*", "2_Dense/*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
_QUANT = re.compile(r"^[A-Za-z0-9_]+$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    path: Path  # what the loaders open: a folder or a GGUF file
    name: str  # the name it was asked by (a hub id, or the file's / folder's name; the embedded model's name)
    source: str  # where it came from, for the start-up log: "embedded", "local", or "hub <repo>@<commit>"


def looks_like_hub_id(name: str) -> bool:
    repo, _, quant = name.partition(":")
    return bool(_REPO_ID.match(repo)) and (not quant or bool(_QUANT.match(quant)))


def resolve_model(name: str | Path | None, *, revision: str | None = None,
                  download_dir: str | Path | None = None) -> ResolvedModel:
    """The local files of `name` (see the module docstring). revision: a branch, tag or commit of a hub repository;
    download_dir: the hub cache to use instead of huggingface_hub's default."""
    if name is None:
        return ResolvedModel(embedded_model_path(), EMBEDDED_NAME, "embedded")
    text = str(name)
    path = Path(text).expanduser()
    if path.exists():
        return ResolvedModel(path, path.stem if path.is_file() else path.name, "local")
    if isinstance(name, Path) or not looks_like_hub_id(text):
        raise LoadError(f"{text}: no such file or folder (nor a Hugging Face hub id such as org/name or "
                        f"org/name:Q4_K_M)")
    repo, _, quant = text.partition(":")
    resolved = _from_hub(text, repo, quant, revision, download_dir)
    logger.info("model %s resolved to %s (%s)", text, resolved.path, resolved.source)
    return resolved


def resolve_config(name: str, *, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The folder holding a hub model's config.json, fetching only that file (for plans; a warm cache works
    offline). Raises LoadError with one line."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(name, "config.json", revision=revision, cache_dir=download_dir)).parent
    except Exception as e:  # huggingface_hub's errors -> one line
        raise LoadError(f"{name}: {_why(e, revision)}") from None


def _from_hub(name: str, repo: str, quant: str, revision: str | None, download_dir) -> ResolvedModel:
    from huggingface_hub import hf_hub_download, snapshot_download

    try:
        if not quant:
            folder = Path(snapshot_download(repo, revision=revision, cache_dir=download_dir,
                                            allow_patterns=HF_FILES))
            if not (folder / "config.json").is_file():
                raise LoadError(f"{name}: the repository has no config.json (a GGUF repository? name a file in it "
                                f"with {name}:QUANT)")
            return ResolvedModel(folder, name, f"hub {repo}@{folder.name[:12]}")
        files, cached_only = _gguf_files(repo, revision, download_dir)
        chosen = _match_quant(name, quant, files, "in the cached snapshot (offline)" if cached_only else
                              "in the repository")
        path = Path(hf_hub_download(repo, chosen, revision=revision, cache_dir=download_dir))
        return ResolvedModel(path, name, f"hub {repo}@{path.parent.name[:12]}")
    except LoadError:
        raise
    except Exception as e:  # huggingface_hub's errors -> one line
        raise LoadError(f"{name}: {_why(e, revision)}") from None


def _gguf_files(repo: str, revision: str | None, download_dir) -> tuple[list[str], bool]:
    """The GGUF files of a repository: listed by the hub, or, offline, those in its cached snapshot (the flag)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled
    from huggingface_hub.file_download import repo_folder_name

    if not constants.HF_HUB_OFFLINE:
        try:
            files = HfApi().list_repo_files(repo, revision=revision)
            return sorted(f for f in files if f.lower().endswith(".gguf")), False
        except OfflineModeIsEnabled:
            pass
        except Exception as e:
            if not _is_connection_error(e):
                raise
    storage = Path(download_dir or constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="model")
    ref = storage / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        raise LocalEntryNotFoundError("not cached")
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.name.lower().endswith(".gguf")), True


def _match_quant(name: str, quant: str, files: list[str], where: str) -> str:
    """The file (or the parts of a split file) whose name carries `quant` as a tag: delimited by a non-alphanumeric
    character on both sides, so Q4_K does not match Q4_K_M."""
    tag = re.compile(rf"(^|[^A-Za-z0-9]){re.escape(quant)}([^A-Za-z0-9_]|$)", re.IGNORECASE)
    matches = [f for f in files if tag.search(Path(f).name[:-len(".gguf")] + ".")]
    groups: dict[str, list[str]] = {}
    for f in matches:
        groups.setdefault(_SPLIT.sub(".gguf", f), []).append(f)
    if len(groups) == 1:
        (parts,) = groups.values()
        if len(parts) > 1:
            raise LoadError(f"{name}: the {quant} file is split into {len(parts)} parts ({', '.join(sorted(parts))});"
                            f" jaxllm reads single-file GGUFs (llama-gguf-split --merge joins them)")
        return parts[0]
    listed = ", ".join(files) if files else "none"
    if not groups:
        raise LoadError(f"{name}: no GGUF file {where} has the quantization {quant} (GGUF files: {listed})")
    raise LoadError(f"{name}: several GGUF files have the quantization {quant}: {', '.join(sorted(groups))}")


def _is_connection_error(e: Exception) -> bool:
    return any(t in type(e).__name__ for t in ("ConnectError", "Timeout", "ConnectionError"))


def _why(e: Exception, revision: str | None) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, GatedRepoError):
        return "the repository is gated: accept its terms on the hub and set HF_TOKEN"
    if isinstance(e, RevisionNotFoundError):
        return f"no revision {revision!r} in the repository"
    if isinstance(e, RepositoryNotFoundError):
        return "no such repository on the hub (or it is private: set HF_TOKEN)"
    if isinstance(e, LocalEntryNotFoundError):
        return "not in the local Hugging Face cache, and the hub cannot be reached (offline: HF_HUB_OFFLINE is set, " \
               "or no connection)"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"cannot fetch it from the hub: {first}"
