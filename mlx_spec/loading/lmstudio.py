"""LM Studio's models folder: PUBLISHER/MODEL/ holding an MLX model (config.json and
safetensors) or GGUF files, as LM Studio's docs ("Import models": ~/.lmstudio/models/
publisher/model/model-file.gguf) and its `lms` CLI (models folder = LM Studio home + /models;
the older ~/.cache/lm-studio/models) describe it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mlx_spec.errors import ModelLoadError

PREFIX = "lmstudio:"


def roots() -> list[Path]:
    """$LMSTUDIO_MODELS alone when set (mlx-spec's, for a folder moved in LM Studio's
    settings), else ~/.lmstudio/models and the older ~/.cache/lm-studio/models."""
    if os.environ.get("LMSTUDIO_MODELS"):
        return [Path(os.environ["LMSTUDIO_MODELS"]).expanduser()]
    return [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]


@dataclass
class LMStudioModel:
    """One model in LM Studio's folder: an MLX folder (`folder`) or a GGUF file (`gguf`)."""

    name: str  # PUBLISHER/MODEL[/FILE.gguf]
    folder: Path
    gguf: Path | None
    size: int

    @property
    def source(self) -> str:
        return PREFIX + self.name


def find(name: str) -> LMStudioModel:
    """LM Studio's PUBLISHER/MODEL (an MLX folder or one GGUF file), or PUBLISHER/MODEL/FILE.gguf.

    Raises:
        ModelLoadError: not a name inside the folder, a named file that is not a .gguf,
            not found, several GGUF files and none named, or neither format.
    """
    parts = name.split("/")
    # Each part names a folder or file inside the models folder: none may be empty (an
    # absolute path, a trailing /), "." or "..", nor hold a backslash.
    if len(parts) not in (2, 3) or any(p in ("", ".", "..") or "\\" in p for p in parts):
        raise ModelLoadError(f"'{PREFIX}{name}' is not an LM Studio model name "
                             "(PUBLISHER/MODEL[/FILE.gguf], e.g. lmstudio:lmstudio-community/gemma-3-270m-it-GGUF)")
    if len(parts) == 3 and not parts[2].lower().endswith(".gguf"):
        raise ModelLoadError(f"'{PREFIX}{name}' names {parts[2]}, which is not a .gguf file; "
                             "the part after PUBLISHER/MODEL/ names one of its GGUF files")
    folders = roots()
    for root in folders:
        folder = root / parts[0] / parts[1]
        if not folder.is_dir():
            continue
        if len(parts) == 3:
            file = folder / parts[2]
            if not file.is_file():
                raise ModelLoadError(f"LM Studio's {folder} has no file {parts[2]}")
            return LMStudioModel(name, folder, file, file.stat().st_size)
        if _is_mlx_folder(folder):
            return LMStudioModel(name, folder, None, _folder_size(folder))
        ggufs = model_ggufs(folder)
        if len(ggufs) == 1:
            return LMStudioModel(name, folder, ggufs[0], ggufs[0].stat().st_size)
        if ggufs:
            names = ", ".join(p.name for p in ggufs)
            raise ModelLoadError(f"LM Studio's {name} holds several GGUF files ({names}); name one: "
                                 f"{PREFIX}{name}/{ggufs[0].name}")
        raise ModelLoadError(f"LM Studio's {folder} holds neither an MLX model (config.json and "
                             "*.safetensors) nor a GGUF file")
    where = " or ".join(str(r) for r in folders)
    raise ModelLoadError(f"LM Studio has no model '{name}' in {where} (set LMSTUDIO_MODELS to its "
                         "models folder if you moved it)")


def list_models() -> list[LMStudioModel]:
    """Every MLX folder and GGUF file under PUBLISHER/MODEL in LM Studio's folders."""
    found = []
    for root in roots():
        for folder in sorted(root.glob("*/*")) if root.is_dir() else ():
            if not folder.is_dir():
                continue
            name = f"{folder.parent.name}/{folder.name}"
            if _is_mlx_folder(folder):
                found.append(LMStudioModel(name, folder, None, _folder_size(folder)))
                continue
            ggufs = model_ggufs(folder)
            for gguf_file in ggufs:
                label = name if len(ggufs) == 1 else f"{name}/{gguf_file.name}"
                found.append(LMStudioModel(label, folder, gguf_file, gguf_file.stat().st_size))
    return found


def _is_mlx_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def model_ggufs(folder: Path) -> list[Path]:
    # Vision models ship their image projector as mmproj-*.gguf beside the language model.
    return sorted(p for p in folder.glob("*.gguf") if not p.name.lower().startswith("mmproj"))


def _folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
