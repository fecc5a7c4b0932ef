#!/usr/bin/env bash
# bench/shaped.py at full size on a lent CUDA machine (no network), from the repository root:
#   call 1 (carry .whl-a): mkdir -p /tmp/wheels && cp .whl-a/* /tmp/wheels/
#   call 2 (carry .whl-b, at once): bash bench/shaped_device.sh [shaped.py flags]
# .whl-a holds mlx and mlx-lm's wheels and the first half of mlx-cuda-13's (`split -n 2`), .whl-b
# the second half: together they are over what one call carries. The halves are joined and
# installed into /tmp/site once per machine; then the seed's pair and the two block-drafter
# pairs run in one shaped.py (one results file). On an H200 this takes about 2 minutes at
# 48 tokens, one warm repetition and γ 0 1 3 7 15 (the defaults below; flags override them).
set -uo pipefail
if [ ! -d /tmp/site/mlx ]; then
  w=/tmp/wheels
  cp .whl-b/* "$w"/ || exit 3
  cat "$w"/cuda.part00 "$w"/cuda.part01 > "$w"/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 3
  rm -f "$w"/cuda.part0*
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$w"/*.whl || exit 3
fi
site=$(python3 -c "import site; print(site.getsitepackages()[0])")
export LD_LIBRARY_PATH="$(ls -d "$site"/nvidia/*/lib 2>/dev/null | paste -sd:):/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 MLX_SPEC_BLAS=reference MLX_SPEC_CACHE=/tmp/mlx-spec-cache
python3 -c "import mlx.core as mx; d = mx.default_device(); print(d, mx.device_info().get('device_name')); assert d.type == mx.DeviceType.gpu" || exit 4
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
cd bench
name=shaped_cuda_full
timeout 400 python3 shaped.py --pairs gemma4-12b/assistant gemma4-12b/dspark gemma4-12b/dflash --profiles published \
    --gammas 0 1 3 7 15 --repeats 1 --max-tokens 48 --name "$name" --no-plot "$@" 2>&1 | grep -v '^\[INFO\]' | tee "${OUT:-/tmp}/$name.log"
cp "results/$name.json" "${OUT:-/tmp}/" 2>/dev/null
