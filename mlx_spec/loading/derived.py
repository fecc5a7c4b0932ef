"""Folders derived from a model folder and kept inside it (the float32 copy of a GGUF
import's weights, its tokenizer index): written whole into a scratch folder, then renamed
into place, so a reader finds all of one or none."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable


def publish(target: Path, fill: Callable[[Path], None], landed: Callable[[], bool]) -> None:
    """`fill(scratch)` writes the folder; then, unless `landed()` says another process's
    `target` arrived meanwhile (a reader may be using it), it replaces `target` (a stale or
    incomplete one). The scratch folder never stays; errors of `fill` and of the rename
    reach the caller."""
    scratch = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    try:
        fill(scratch)
        if landed():
            return
        shutil.rmtree(target, ignore_errors=True)
        os.replace(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
