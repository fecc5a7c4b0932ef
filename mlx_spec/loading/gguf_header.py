"""What a GGUF file's header says about whether mlx-spec can run it, read without loading
weights (`gguf_file` parses only the metadata and tensor index)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from mlx_spec.errors import ModelLoadError
from mlx_spec.loading.gguf_architectures import ARCHITECTURES


@dataclass(frozen=True)
class GGUFHeader:
    architecture: str
    file_type: str | None  # e.g. "Q4_K_M" (general.file_type), when recorded
    mtp_layers: int  # {arch}.nextn_predict_layers: MTP tensors inside the file


def read_gguf_header(path: Path) -> GGUFHeader:
    """The few metadata fields that decide whether we can run a GGUF file."""
    return _read_header(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _read_header(path: str, _mtime: int) -> GGUFHeader:
    import gguf

    from mlx_spec.loading.gguf_file import read_gguf_file

    try:
        metadata = read_gguf_file(Path(path)).metadata
    except (ValueError, OSError, IndexError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path} is not a readable GGUF file ({error})") from None

    def scalar(key):
        return metadata.get(key)

    arch = scalar("general.architecture") or "?"
    file_type = scalar("general.file_type")
    try:
        file_type = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        file_type = str(file_type)
    return GGUFHeader(arch, file_type, int(scalar(f"{arch}.nextn_predict_layers") or 0))


def gguf_problem(header: GGUFHeader) -> str | None:
    """Why our GGUF import cannot read a file with this header, or None if it can."""
    if header.architecture in ARCHITECTURES:
        return None
    return (f"a GGUF of architecture '{header.architecture}', which mlx-spec cannot import "
            f"(it imports {', '.join(sorted(ARCHITECTURES))})")
