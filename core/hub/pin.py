"""Pin a Hub source to an immutable commit and list its files (sizes, sha256s)."""

from __future__ import annotations

from dataclasses import dataclass

from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url

from core.hub.errors import HubFileMissing, HubNotSafetensors, hub_errors
from core.hub.refs import HubRef, hub_sources, parse_hub_source, replace_sources
from engine.io.lora import ADAPTER_CONFIG
from engine.recipe import Recipe, parse_recipe, recipe_to_dict

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    sha256: str | None  # LFS files: the Hub knows it; small files are hashed after download


@dataclass(frozen=True)
class PinnedRepo:
    repo: str
    revision: str  # as asked for (a branch, say)
    sha: str  # the commit it pointed at: all the job will ever read
    files: dict[str, HubFile]

    @property
    def source(self) -> str:
        return str(HubRef(self.repo, self.sha))

    @property
    def weight_files(self) -> list[str]:
        return sorted(n for n in self.files if n.endswith(".safetensors") and "/" not in n)


def pin(ref: HubRef, token: str | None) -> PinnedRepo:
    """Resolve `ref` to its commit sha now, so a branch moving later changes nothing."""
    with hub_errors(f"hf://{ref.repo}@{ref.revision}"):
        info = HfApi().model_info(
            ref.repo, revision=ref.revision, files_metadata=True, token=token or False
        )
    files = {}
    for sibling in info.siblings or []:
        lfs = sibling.lfs
        size = lfs.size if lfs is not None else (sibling.size or 0)
        files[sibling.rfilename] = HubFile(
            sibling.rfilename, int(size), lfs.sha256 if lfs else None
        )
    pinned = PinnedRepo(ref.repo, ref.revision, str(info.sha), files)
    _check_weights(pinned)
    _check_readable(pinned, token)
    return pinned


def _check_readable(pinned: PinnedRepo, token: str | None) -> None:
    """A gated repository shows its file list to anyone; reading a file tells whether the
    credential may actually download (one HEAD request, for config.json)."""
    where = f"hf://{pinned.repo}@{pinned.revision}"
    # a LoRA adapter's repository (the adapter of a model+adapter source) has its own config
    probe = next((n for n in ("config.json", ADAPTER_CONFIG) if n in pinned.files), None)
    if probe is None:
        raise HubFileMissing(f"{where}: no config.json: not a transformers checkpoint")
    with hub_errors(where):
        get_hf_file_metadata(
            hf_hub_url(pinned.repo, probe, revision=pinned.sha), token=token or False
        )


def _check_weights(pinned: PinnedRepo) -> None:
    where = f"hf://{pinned.repo}@{pinned.revision}"
    if pinned.weight_files:
        return
    pickled = sorted(n for n in pinned.files if n.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise HubNotSafetensors(
            f"{where}: only pickle weights ({', '.join(pickled[:3])}); they can run code when "
            "loaded, so they are refused. Publish a safetensors copy (e.g. "
            "AutoModelForCausalLM.from_pretrained(repo).save_pretrained(out, "
            "safe_serialization=True), then upload it) and merge that",
        )
    raise HubNotSafetensors(f"{where}: no *.safetensors weights in the repository")


def pin_recipe(recipe: Recipe, token: str | None) -> tuple[Recipe, list[PinnedRepo]]:
    """The recipe with each hf:// source replaced by `hf://repo@<commit sha>`, and the pins."""
    pins = {source: pin(parse_hub_source(source), token) for source in hub_sources(recipe)}
    mapping = {source: p.source for source, p in pins.items()}
    return parse_recipe(replace_sources(recipe_to_dict(recipe), mapping)), list(pins.values())
