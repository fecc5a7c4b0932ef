#!/usr/bin/env bash
# Greedy exactness under the BLAS in use (issue 23): the embedded 270M in float32 with every
# drafter that runs on it, γ = 1..6 and auto, generating across the 512-token window
# (`window` prompt), each setting's tokens checked against drafting off by `mlx-spec bench`
# (md5; a first difference is reported with the target's top-2 logit gap, and a gap within
# 4 ulp is a numerical near-tie). ~15 min on a 2-core CPU with MKL.
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results
run() { echo "+ mlx-spec bench $*" >&2; mlx-spec bench "$@"; }
run --prompt window --drafter ngram --gamma 1,2,3,4,5,6 --auto -n 160 --runs 1 --json \
    > "$out/exactness_gemma270m-ngram_window.json"
run --prompt window --draft-model default --draft-quantize 8 --gamma 1,3,6 -n 96 --runs 1 --json \
    > "$out/exactness_gemma270m-q8_window.json"
