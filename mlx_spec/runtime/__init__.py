"""Every change mlx-spec makes to the process beyond its own objects, installed in one place.

`install()` makes the first three, once, in this order; `mlx_spec/__init__.py` calls it, so
they are in place before any `import mlx_spec...` returns.

1. An optimised BLAS, loaded with RTLD_GLOBAL before `mlx.core` (`mlx_spec.runtime.blas.load`):
   `ctypes.CDLL(libmkl_rt | libopenblas, RTLD_GLOBAL)` wins the symbol lookup of MLX's
   `libmlx.so`, and the library's thread count is set to half the cores (unless the user set
   one). Why: the `mlx[cpu]` Linux wheel bundles the netlib reference BLAS, whose naive
   `cblas_sgemm` makes a verify of k rows cost about k single steps; under MKL the embedded
   270M decodes 2.45x faster and n-gram `auto` 1.90x its plain decoding, against 1.05x
   under the reference BLAS (`bench/blas.py`, docs/performance.md). Nothing is loaded on
   macOS or beside CUDA.
2. `mlx_lm`'s package `__init__` deferred (`mlx_spec.runtime.mlx_lm_import.defer_package_init`): a module
   object in `sys.modules["mlx_lm"]` and a finder first on `sys.meta_path`, which run the
   real `__init__` the first time anything but mlx-lm's model, kernel and version modules
   is imported or a package attribute is read. Why: that `__init__` imports transformers
   and huggingface_hub, ~1 s of a warm `mlx-spec generate` that needs neither
   (`bench/startup.py`, tests/runtime/test_startup.py.py). Nothing changes when mlx-lm came first.
3. mlx-lm's quantized attention routed through ours: the module global
   `mlx_lm.models.base.quantized_scaled_dot_product_attention`, which mlx-lm's attention
   calls for every quantized cache, becomes `mlx_spec.cache.attention.dispatch_quantized_attention`.
   Our quantized cache layers hand attention `PackedKV` / `ChannelKeys`, which run our
   kernels; anything else (mlx-lm's own `QuantizedKVCache`) still runs mlx-lm's function.
   Why: folding the query heads that share a KV head into one matmul gives the same result
   bit for bit without copying the packed K/V per query head (window layer at 8-bit 481 µs
   against mlx-lm's 580), and keys by channel need their own kernel (a global layer at 8k
   keys, 8-bit: 2,929 µs against mlx-lm's 11,060); `bench/kv_decode_profile.py`,
   docs/kv-cache.md. Installed here, it is in place from `import mlx_spec` on, before any
   cache of ours can reach mlx-lm's attention.

Settings kept in module globals where they are read, and set there:

- `blas._setter`, `blas._narrow`, `blas._wide`: the BLAS's set-threads call and the two
  counts, kept by `blas.load` (change 1) unless the user fixed a count; `blas.threads_for` widens a
  forward of `blas.WIDE_ROWS` rows or more to every free core (4 clients' aggregate tok/s
  1.18x, `bench/wide_rows.py`). `blas._load` / `blas._others`: the last reading of other
  processes' CPU use (`blas.free_cores`). `blas._state`: what `load` did.
- `costs._recalibrate` / `costs._measured_here`: `--recalibrate` measures each cost curve
  afresh once in this process; each CLI command sets it (`costs.recalibrate`), so one
  invocation's flag never leaks into the next.
- `models.hub._forced` and `HF_HUB_OFFLINE`, within `hub.forced_offline()` only: a command
  that must not download resolves Hub models from the cache, and says so in its errors.

Changed by one command while it runs: `distributed.follow_quietly` sends ranks other than
0 to /dev/null (stdout, stderr, warnings); `mlx-spec chat` takes SIGINT during a turn.
"""

from __future__ import annotations

from mlx_spec.runtime.blas import load as load_blas
from mlx_spec.runtime.mlx_lm_import import defer_package_init


def install() -> None:
    """Make the process-wide changes 1-3 above; calling it again changes nothing."""
    load_blas()  # first: mlx.core must not be loaded yet, or the bundled BLAS wins
    defer_package_init()
    route_quantized_attention()


def route_quantized_attention() -> None:
    """Change 3: mlx-lm's attention on quantized caches goes through our dispatch."""
    # Imported here, not above: mlx.core (which it loads) must come after blas.load().
    import mlx_lm.models.base as mlx_lm_base

    from mlx_spec.cache.attention import dispatch_quantized_attention

    mlx_lm_base.quantized_scaled_dot_product_attention = dispatch_quantized_attention
