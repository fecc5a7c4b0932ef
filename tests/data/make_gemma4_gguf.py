"""Regenerate the tiny Gemma 4 GGUFs in tests/data with llama.cpp's own converter.

tests/loading/test_gemma4_gguf.py.py imports these files and compares them with the Hugging Face
folders they were converted from (rebuilt bit for bit by `save_hf_checkpoints`, from numpy
seeds), so the reference for the GGUF layout is llama.cpp's `convert_hf_to_gguf.py`, not
our own writer. llama.cpp's code is not part of this repository; run it from a checkout:

    python -m venv /tmp/convert-venv
    /tmp/convert-venv/bin/pip install torch numpy safetensors sentencepiece transformers protobuf
    python tests/data/make_gemma4_gguf.py --llama-cpp PATH/TO/llama.cpp --python /tmp/convert-venv/bin/python

(this script itself runs in mlx-spec's environment; the converter runs in the one with
torch). The committed files came from the llama.cpp vendored by llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mlx_spec.testing.tiny_gemma4 import save_hf_checkpoints

DATA = Path(__file__).parent
# (checkpoint, llama.cpp --outtype): float32 for exact comparisons, Q8_0 as llama.cpp
# quantizes, for the quantized import.
FILES = [("e2b", "f32"), ("12b", "f32"), ("12b", "q8_0"), ("12b-assistant", "f32"),
         ("12b-assistant", "q8_0")]


def gguf_path(name: str, outtype: str) -> Path:
    return DATA / f"tiny-gemma4-{name}-{outtype}.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source folder")
    parser.add_argument("--python", default=sys.executable, help="a Python with torch for the converter")
    args = parser.parse_args()
    converter = args.llama_cpp / "convert_hf_to_gguf.py"
    with tempfile.TemporaryDirectory() as tmp:
        folders = save_hf_checkpoints(tmp)
        for name, outtype in FILES:
            out = gguf_path(name, outtype)
            subprocess.run([args.python, str(converter), str(folders[name]), "--outtype", outtype,
                            "--outfile", str(out)], check=True,
                           env={**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")})
            print(f"wrote {out} ({out.stat().st_size // 1024} KB)")


if __name__ == "__main__":
    main()
