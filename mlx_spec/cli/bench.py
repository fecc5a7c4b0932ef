"""`mlx-spec bench`: find the γ that is fastest on this machine for this model pair.

The sweep itself is `mlx_spec.apps.sweep.run_sweep`; this command parses, runs it with a
progress bar on stderr, and renders a table, JSON, CSV or a plot.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import mlx.core as mx
import typer

from mlx_spec.apps import calibration
from mlx_spec.apps.distributed import world
from mlx_spec.apps.runner import AUTO, Gamma
from mlx_spec.apps.stream import encode_prompt
from mlx_spec.apps.sweep import BASELINE, DEFAULT_GAMMAS, TREE, SweepResult, run_sweep
from mlx_spec.cli.app import app
from mlx_spec.cli.common import (
    OUTPUT,
    DrafterOpt,
    DraftKvBitsOpt,
    DraftOnOpt,
    DraftOpt,
    DraftQuantizeOpt,
    DtypeOpt,
    GroupSizeOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    KvStartOpt,
    MaxTokensOpt,
    ModelOpt,
    ModelOptions,
    PresetOpt,
    QuantizeOpt,
    RecalibrateOpt,
    SamplingOptions,
    SeedOpt,
    setup_models,
    warn_replaced,
)
from mlx_spec.cli.render import human_bytes
from mlx_spec.errors import MlxSpecError, UsageError
from mlx_spec.loading.stores import drafting_defaults as store_drafting
from mlx_spec.platform import blas
from mlx_spec.progress import StderrProgress
from mlx_spec.prompts import committed_prompts, resolve_prompt

# The reference measurement's settings after drafting off (DESIGN §2: Ollama's gemma4:12b
# with its built-in draft on an M3 Pro), and the automatic policy.
REFERENCE_GAMMAS = (1, 2, 3, 5, AUTO)
SWEPT = "--gamma in a sweep (γ = 0 is the baseline)"  # the name in a bad γ's message

CSV_FIELDS = (
    "prompt", "setting", "gamma", "runs", "decode_tps", "tps_min", "tps_max", "spread",
    "speedup", "predicted_speedup", "cost_model_speedup", "cold_tps", "acceptance_rate",
    "acceptance_by_position", "mean_accepted_length", "mean_gamma", "prefill_time",
    "prefill_share", "bandwidth", "peak_memory", "generated", "md5", "identical", "mismatch_at",
    "near_tie", "acceptance_by_rank",
)


@app.command()
def bench(
    model: ModelOpt = None,
    draft_model: DraftOpt = None,
    drafter: DrafterOpt = None,
    preset: PresetOpt = None,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
    draft_quantize: DraftQuantizeOpt = None,
    draft_on: DraftOnOpt = None,
    group_size: GroupSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    kv_start: KvStartOpt = None,
    draft_kv_bits: DraftKvBitsOpt = None,
    gammas: Annotated[Optional[list[str]], typer.Option(
        "--gamma", "-g", metavar="N[,N...]|auto|tree",
        help="γ values to compare with drafting off (repeatable or comma-separated; 'auto' adds "
             "the automatic policy, 'tree' draft trees). Default: 1 2 3 5; for an Ollama model that "
             "carries its own draft (-m ollama:NAME), the reference run's 1 2 3 5 auto, plus the "
             "model file's γ.")] = None,
    auto: Annotated[bool, typer.Option("--auto", help="Also run --gamma auto.")] = False,
    tree: Annotated[bool, typer.Option(
        "--tree", help="Also run draft trees (several continuations verified in one pass, shaped by "
                       "the cost curve: the suffix or n-gram drafter's earlier matches, a draft model's or MTP "
                       "assistant's next likeliest tokens where it is unsure); reports acceptance by "
                       "sibling rank.")] = False,
    recalibrate: RecalibrateOpt = False,
    prompts: Annotated[Optional[list[str]], typer.Option(
        "--prompt", metavar="NAME|@FILE|TEXT",
        help=f"Prompt(s) to run (repeatable): a committed one "
             f"({', '.join(committed_prompts())}, or 'all'), @file, or literal text. Default: long.")] = None,
    runs: Annotated[int, typer.Option(
        "--runs", "-r", min=1, max=50, help="Warm runs per setting, after one cold run.")] = 3,
    max_tokens: MaxTokensOpt = 128,
    temp: Annotated[float, typer.Option(
        "--temp", "-t", min=0.0, rich_help_panel="Sampling",
        help="Run the sweep at this temperature (the one used in practice); above 0 outputs "
             "differ by design, so there is no identity check.")] = 0.0,
    seed: SeedOpt = 0,
    chat: Annotated[bool, typer.Option(
        "--chat/--raw", rich_help_panel="Sampling",
        help="Wrap the prompts in the chat template, or use them as raw text.")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", rich_help_panel=OUTPUT, help="Print the results as one JSON object instead of a table.")] = False,
    csv_file: Annotated[Optional[Path], typer.Option(
        "--csv", rich_help_panel=OUTPUT, metavar="FILE",
        help="Also write one CSV row per (prompt, setting) to FILE ('-' for stdout).")] = None,
    plot: Annotated[Optional[Path], typer.Option(
        "--plot", rich_help_panel=OUTPUT, metavar="FILE.png",
        help="Also plot speedup and acceptance versus γ (needs matplotlib).")] = None,
    compare: Annotated[Optional[Path], typer.Option(
        "--compare", rich_help_panel=OUTPUT, metavar="FILE.json",
        help="A `bench --json` result from one machine: show its speedups next to these "
             "(for a run across machines with mlx.launch).")] = None,
    clients: Annotated[Optional[int], typer.Option(
        "--clients", min=1, max=64, metavar="N",
        help="Instead of the γ sweep: N requests at once, decoded together in one batch as "
             "`serve --parallel N` decodes them (in-process, no HTTP), drafting off and each --gamma "
             "(default auto); aggregate and per-request tok/s, time to first token, acceptance. "
             "The --prompt list is cycled over the N requests (default: quote, short).")] = None,
) -> None:
    """Sweep γ against drafting off: decode tok/s, speedup, acceptance, Theorem 3.8 prediction.

    At temperature 0 every output must be token-identical (md5) to drafting off; a mismatch
    fails the command. The recommendation is the fastest exact setting.

    `mlx-spec bench -m ollama:NAME` on a model whose Ollama model file has a draft runs the
    reference run's procedure on those weights: drafting off, then γ = 1, 2, 3, 5 and auto
    (and the model file's own γ), md5 identity and per-position acceptance.
    """
    w = world()
    with w.together():  # across ranks: rank 0 reads the files, and a bad flag ends every rank
        if drafter == "none":
            raise UsageError("bench compares drafting with drafting off: --drafter must be model, mtp, suffix or ngram")
        store = store_drafting(model) if model is not None and draft_model is None and drafter not in ("ngram", "suffix") else None
        if store is not None and store.draft is None:
            store = None
        gamma_list = parse_gammas(gammas) if gammas else [Gamma(AUTO)] if clients else default_gammas(store)
        if clients and (tree or any(g.tree for g in gamma_list)):
            raise UsageError("a batch drafts chains, not trees: --clients takes no --tree", flag="--clients")
        if auto and not any(g.auto for g in gamma_list):
            gamma_list.append(Gamma(AUTO))
        if tree and not any(g.tree for g in gamma_list):
            gamma_list.append(Gamma(TREE))
        specs = prompts or (["quote", "short"] if clients else ["long"])
        if "all" in specs:
            specs = [s for s in specs if s != "all"] + [s for s in committed_prompts() if s not in specs]
        named = []
        for spec in specs if w.is_root else ():
            name, text, replaced = resolve_prompt(spec)
            if name == "custom" and len(spec.split()) == 1:
                _check_one_word_prompt(spec)
            warn_replaced(replaced, f"prompt {name!r}")
            named.append((name, text))
        if plot is not None and plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            raise UsageError("--plot needs a .png, .svg or .pdf file name")
        if plot is not None and w.is_root:
            _require_matplotlib()
        single = _read_compare(compare) if compare is not None and w.is_root else None
    named = [tuple(pair) for pair in w.broadcast_json(named)]

    # the sweep's own temperature and seed, not the preset's sampling defaults
    calibration.recalibrate(recalibrate)
    setup = setup_models(ModelOptions.from_flags(locals(), gamma=AUTO, chat_template=None),
                         SamplingOptions(temp=temp, seed=seed), preset_sampling=False)
    params = setup.params
    tokenizer = setup.pair.tokenizer
    ids = {}
    for name, text in named:
        key, k = name, 2
        while key in ids:
            key, k = f"{name}{k}", k + 1
        ids[key] = encode_prompt(tokenizer, text, chat)

    if clients:
        _bench_clients(setup, list(ids.values()), clients, gamma_list, runs, max_tokens, json_out)
        return
    with StderrProgress() as progress:
        result = run_sweep(setup.pair, ids, drafter=setup.drafter, gammas=gamma_list, warm_runs=runs,
                           max_tokens=max_tokens, params=params, engine_options=setup.engine_options,
                           progress=progress.task("bench", each=True),
                           calibration_progress=progress.task("calibrating the cost curve"))
    if single is not None:
        for summary in result.summaries:
            summary.single_speedup = single.get((summary.prompt, summary.setting))

    if json_out:
        print(json.dumps({"models": setup.models, "device": str(mx.default_device()), "blas": blas.describe(),
                          "model_file_gamma": store.gamma if store is not None else None,
                          **result.as_dict()}, ensure_ascii=False))
    else:
        _print_table(result, setup)
        if store is not None:
            _print_store_note(model, store)
    if not w.is_root:  # across ranks, rank 0 alone writes files
        csv_file = plot = None
    if csv_file is not None:
        _write_csv(result, csv_file)
    if plot is not None:
        _plot(result, plot, f"{setup.target}" + (f" + {setup.draft}" if setup.draft else ""))
        print(f"plot written to {plot}", file=sys.stderr)
    for near_tie in result.near_ties:
        _warn(f"numerical near-tie, not an exactness failure: {near_tie}", "yellow")
    if not result.ok:
        for mismatch in result.failures:
            _warn(f"IDENTITY CHECK FAILED: {mismatch}", "bold red")
        raise typer.Exit(1)


def _bench_clients(setup, prompt_ids: list, clients: int, gammas: list[Gamma], runs: int, max_tokens: int,
                   json_out: bool) -> None:
    """`bench --clients N`: `clients.bench_clients` over the prompts cycled to N requests,
    rendered; exit 1 where a request's greedy tokens differ from drafting off's."""
    from mlx_spec.apps.clients import bench_clients

    requests = [prompt_ids[i % len(prompt_ids)] for i in range(clients)]
    with StderrProgress() as progress:
        summaries = bench_clients(setup.pair, requests, drafter=setup.drafter, gammas=gammas, runs=runs,
                                  max_tokens=max_tokens, params=setup.params, engine_options=setup.engine_options,
                                  progress=progress.task("bench", each=True))
    if json_out:
        print(json.dumps({"models": setup.models, "device": str(mx.default_device()), "blas": blas.describe(),
                          "clients": clients, "max_tokens": max_tokens, "runs": runs,
                          "temperature": setup.params.temperature,
                          "settings": [s.as_dict() for s in summaries]}, ensure_ascii=False))
    else:
        from rich import box
        from rich.console import Console
        from rich.table import Table

        console = Console(highlight=False)
        if not console.is_terminal:
            console.width = 120  # piped or redirected: room for the whole table
        table = Table(title=f"{clients} clients at once · {setup.target} · {max_tokens} tokens each · "
                            f"1 cold + {runs} warm runs per setting, interleaved; medians",
                      title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for name in ("setting", "aggregate tok/s", "vs off", "per request tok/s", "TTFT s", "max TTFT s",
                     "α̂", "batch", "identical"):
            table.add_column(name, justify="left" if name == "setting" else "right")
        for s in summaries:
            table.add_row(s.setting, f"{s.aggregate_tps:.1f}", f"{s.speedup:.2f}×", f"{s.per_request_tps:.1f}",
                          f"{s.ttft:.2f}", f"{s.max_ttft:.2f}",
                          "—" if s.acceptance_rate is None else f"{s.acceptance_rate:.2f}", f"{s.mean_batch:.1f}",
                          "—" if s.identical is None else "✓" if s.identical else "[red]✗[/red]")
        console.print(table)
        console.print(f"{mx.default_device()} · BLAS {blas.summary()}", style="dim")
    if any(s.identical is False for s in summaries):
        _warn("IDENTITY CHECK FAILED: a request's tokens in the batch differ from drafting off's", "bold red")
        raise typer.Exit(1)


def default_gammas(store=None) -> list[Gamma]:
    """The γ sweep when --gamma is not given: DEFAULT_GAMMAS; for a store model with its own
    draft (`stores.drafting_defaults`), the reference run's REFERENCE_GAMMAS with the model
    file's γ among them."""
    if store is None:
        return list(DEFAULT_GAMMAS)
    fixed = sorted({g for g in REFERENCE_GAMMAS if g != AUTO} | ({store.gamma} if store.gamma else set()))
    return [Gamma.parse(g, name=SWEPT, minimum=1) for g in fixed] + [Gamma(AUTO)]


def parse_gammas(values: list[str]) -> list[Gamma]:
    """'1,2,3' / ['1', '2', 'auto'] → [1, 2, 3, 'auto'] as `Gamma`s, validated, duplicates dropped."""
    out: list[Gamma] = []
    for value in values:
        for part in str(value).replace(" ", ",").split(","):
            if part:
                gamma = Gamma.parse(part, name=SWEPT, minimum=1)
                if gamma not in out:
                    out.append(gamma)
    if not out:
        raise UsageError("the γ list is empty", flag="--gamma")
    return out


def _check_one_word_prompt(spec: str) -> None:
    """One word that is not a committed prompt is most likely a misspelt name: near one, it is
    an error; otherwise it runs as text, and stderr says so."""
    import difflib

    names = ", ".join(committed_prompts())
    close = difflib.get_close_matches(spec, committed_prompts(), n=1)
    if close:
        raise UsageError(f"--prompt {spec!r} is not a committed prompt: did you mean {close[0]!r}? "
                           f"Committed: {names}; @FILE reads a file")
    print(f"warning: --prompt {spec!r} is not a committed prompt ({names}) or @FILE: it runs as "
          "literal text, labelled 'custom'", file=sys.stderr)


def _read_compare(path: Path) -> dict:
    """(prompt, setting) → speedup from a saved `bench --json` output."""
    try:
        data = json.loads(path.read_text())
        return {(s["prompt"], s["setting"]): s["speedup"] for s in data["settings"]}
    except OSError as error:
        raise MlxSpecError(f"cannot read {path}: {error.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise MlxSpecError(f"{path} is not the output of `mlx-spec bench --json`") from None


def _warn(line: str, style: str) -> None:
    from rich.console import Console

    Console(stderr=True, highlight=False).print(line, style=style, markup=False, soft_wrap=True)


def _fmt_positions(values: list[float]) -> str:
    return " ".join(f"{a:.2f}" for a in values) if values else "—"


def _print_table(result: SweepResult, setup) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 120  # piped or redirected: room for the whole table
    params = result.params
    console.print(f"γ sweep · {setup.target}" + (f" + {setup.draft}" if setup.draft else "")
                  + f" · drafter {result.drafter} · T = {params.temperature:g} · {result.max_tokens} tokens"
                  + f" · 1 cold + {result.warm_runs} warm runs per setting, interleaved", style="bold")
    console.print(f"{mx.default_device()} · BLAS {blas.summary()}", style="dim")

    def table(title: str, columns: list[str]) -> Table:
        t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for name in columns:
            t.add_column(name, justify="left" if name in ("setting", "by position", "md5 of tokens") else "right",
                         no_wrap=name != "by position")
        return t

    tp = result.comm is not None
    compared = any(s.single_speedup is not None for s in result.summaries)
    if tp:
        c = result.comm
        console.print(f"tensor parallel over {c.ranks} ranks: {c.per_forward} all-reduces per target forward, "
                      f"{c.latency[0] * 1e3:.3f} ms each at width 1 (best of 5 chains; time per round = "
                      "count × latency at the round's width, not counting waits for a slower rank)", style="bold")
    for prompt, n_tokens in result.prompts.items():
        rows = [s for s in result.summaries if s.prompt == prompt]
        by_rank = any(s.acceptance_by_rank for s in rows)  # a tree ran: acceptance by sibling rank too
        speed = table(f"prompt {prompt!r} ({n_tokens} tokens) · decode speed, warm medians",
                      ["setting", "tok/s", "spread", "cold", "speedup", "Thm 3.8", "cost model",
                       "prefill s", "GB/s"])
        accept = table(f"prompt {prompt!r} · acceptance and identity",
                       ["setting", "α̂", "by position", "accepted len", "mean γ", "md5 of tokens"]
                       + (["by rank"] if by_rank else []))
        for s in rows:
            is_base = s.setting == BASELINE
            label = f"[bold]{s.setting}[/bold]" + (" ★" if s.setting == result.recommendation else "")
            spread = f"±{s.spread / 2:.0%}" if s.runs > 1 else "—"  # one warm run has no spread
            speed.add_row(label, f"{s.decode_tps:.1f}", spread, f"{s.cold_tps:.1f}",
                          f"{s.speedup:.2f}×",
                          "—" if is_base or s.predicted_speedup is None else f"{s.predicted_speedup:.2f}×",
                          "—" if is_base else f"{s.cost_model_speedup:.2f}×",
                          f"{s.prefill_time:.2f} ({s.prefill_share:.0%})",
                          f"{s.bandwidth / 1e9:.2f}")
            identity = (s.md5[:12] if s.identical is None else
                        f"{s.md5[:12]} ✓" if s.identical else
                        f"[yellow]≈ near-tie at token {s.mismatch_at}[/yellow]" if s.near_tie else
                        f"[red]✗ differs at token {s.mismatch_at}[/red]")
            drafted = not is_base and s.mean_gamma > 0  # α̂ of nothing drafted is no measurement
            accept.add_row(label,
                           f"{s.acceptance_rate:.3f}" if drafted else "—",
                           _fmt_positions(s.acceptance_by_position) if drafted else "—",
                           f"{s.mean_accepted_length:.2f}", f"{s.mean_gamma:.2f}", identity,
                           *([_fmt_positions(s.acceptance_by_rank)] if by_rank else []))
        console.print(speed)
        console.print(accept)
        if tp or compared:
            console.print(_parallel_table(table, prompt, rows, result.comm, compared))
    c = result.costs
    console.print(f"cost curve: target step {c.verify[0] * 1e3:.1f} ms, draft step {c.draft_step * 1e3:.2f} ms "
                  f"(c = {c.c:.3f}); verify of w positions / one step: "
                  + ", ".join(f"{w}: {t / c.verify[0]:.2f}" for w, t in enumerate(c.verify, 1))
                  + f"; peak memory {human_bytes(max(s.peak_memory for s in result.summaries))}")
    console.print("Thm 3.8 = (1 − α^(γ+1)) / ((1 − α)(γc + 1)) with α = accepted / reached draft positions, "
                  "measured c and mean γ drafted per round "
                  "(it assumes a verify costs one step); cost model = measured verify curve and per-position "
                  "acceptance; a tree's by position is by depth, its mean γ nodes per round, its cost model the "
                  "policy's forecast", style="dim")
    if result.identity_checked:
        console.print(identity_note(result))
    else:
        console.print(f"T = {params.temperature:g}: sampled outputs differ by design; no identity check")
    console.print(f"[bold]{recommendation_text(result)}[/bold]")


def identity_note(result) -> str:
    """The identity check's verdict, then, where drafting off itself picked tokens whose top
    two logits were within rounding of each other, how many: a setting that is exact may pick
    the other one there (a near-tie, reported apart from a mismatch)."""
    ties = sum(map(len, result.baseline_near_ties.values()))
    verdict = ("[red]OUTPUT MISMATCH[/red]" if not result.ok else
               "every setting's tokens equal drafting off's, except at near-ties (stderr names them)"
               if result.near_ties else "every setting's tokens equal drafting off's")
    note = f"identity (md5 of token ids, T = 0): {verdict}."
    if ties:
        note += (f" Near-ties: at {ties} token{'s' if ties != 1 else ''} of drafting off's output the "
                 "top two logits were within rounding of each other, so an exact setting may pick the "
                 "other token there.")
    return note


def _print_store_note(model: str, store) -> None:
    name = model.removeprefix("ollama:")
    print(f"{model}'s model file drafts with its draft layer at γ = {store.gamma} (draft_num_predict). "
          f"Ollama's own numbers for the same weights: `ollama run {name} --verbose` prints the eval rate "
          "(decode tok/s); `/set parameter draft_num_predict 0` turns its draft off (docs/models.md: Side by side with Ollama).")


def recommendation_text(result: SweepResult) -> str:
    """One line for people: which setting to use, and whether the gain is within the noise."""
    best = result.recommendation
    if best == BASELINE:
        return "recommendation: drafting does not pay here; use --gamma 0 (or --gamma auto, which parks at 0)"
    flag = ("--gamma auto" if best == "auto" else "draft trees (bench --tree)" if best == TREE
            else f"--gamma {best.split('=')[1]}")
    line = f"recommendation: {flag} ({result.recommended_speedup:.2f}× vs drafting off)"
    noise = max((s.spread / 2 for s in result.summaries if s.setting in (best, BASELINE)), default=0.0)
    if result.recommended_speedup - 1 <= noise:
        line += f", within the run-to-run spread (±{noise:.0%}): drafting does not clearly pay here"
    return line


def csv_rows(result: SweepResult) -> list[dict]:
    """One flat row per (prompt, setting); per-position (and per-rank) acceptance as 'a1;a2;...'."""
    rows = []
    for s in result.summaries:
        row = {k: getattr(s, k) for k in CSV_FIELDS}
        for name in ("acceptance_by_position", "acceptance_by_rank"):
            row[name] = ";".join(f"{a:.4f}" for a in getattr(s, name))
        rows.append(row)
    return rows
def _parallel_table(table, prompt: str, rows, comm, compared: bool):
    """Speedup across ranks next to one machine's, and what the all-reduces cost per round."""
    columns = ["setting", "speedup"] + (["1 machine"] if compared else [])
    if comm is not None:
        columns += ["all-reduces/round", "all-reduce ms/round", "share of round"]
    t = table(f"prompt {prompt!r} · tensor parallel over {comm.ranks if comm else '?'} ranks", columns)
    for s in rows:
        cells = [s.setting, f"{s.speedup:.2f}×"]
        if compared:
            cells.append("—" if s.single_speedup is None else f"{s.single_speedup:.2f}×")
        if comm is not None:
            cells += [f"{s.all_reduces_per_round:.1f}", f"{s.comm_time_per_round * 1e3:.2f}", f"{s.comm_share:.0%}"]
        t.add_row(*cells)
    return t


def _write_csv(result: SweepResult, path: Path) -> None:
    rows = csv_rows(result)
    if str(path) == "-":
        writer = csv.DictWriter(sys.stdout, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
        return
    try:
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    except OSError as error:
        raise MlxSpecError(f"cannot write {path}: {error.strerror}") from None


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MlxSpecError("--plot needs matplotlib: pip install 'mlx-spec[plot]'") from None


def _plot(result: SweepResult, path: Path, models: str) -> None:
    """Speedup (measured, Theorem 3.8, cost model) and acceptance versus γ, one line per prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_speed, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for prompt in result.prompts:
        rows = [s for s in result.summaries if s.prompt == prompt]
        fixed = sorted((s for s in rows if isinstance(s.gamma, int)), key=lambda s: s.gamma)
        xs = [s.gamma for s in fixed]
        suffix = f" ({prompt})" if len(result.prompts) > 1 else ""
        line, = ax_speed.plot(xs, [s.speedup for s in fixed], "o-", label="measured" + suffix)
        ax_speed.plot(xs, [s.predicted_speedup for s in fixed], "--", color=line.get_color(),
                      alpha=0.6, label="Theorem 3.8" + suffix)
        ax_speed.plot(xs, [s.cost_model_speedup for s in fixed], ":", color=line.get_color(),
                      alpha=0.8, label="cost model" + suffix)
        drafted = [s for s in fixed if s.gamma != 0]
        ax_acc.plot([s.gamma for s in drafted], [s.acceptance_rate for s in drafted], "o-",
                    color=line.get_color(), label="α̂" + suffix)
        for s in rows:
            if s.gamma == "auto":
                ax_speed.plot([s.mean_gamma], [s.speedup], "*", markersize=12, color=line.get_color(),
                              label=f"auto (mean γ {s.mean_gamma:.1f})" + suffix)
                ax_acc.plot([s.mean_gamma], [s.acceptance_rate], "*", markersize=12, color=line.get_color())
    ax_speed.axhline(1.0, color="grey", linewidth=0.8)
    ax_speed.set(xlabel="γ (draft tokens per round)", ylabel="speedup vs drafting off",
                 title="decode speedup")
    ax_acc.set(xlabel="γ (draft tokens per round)", ylabel="acceptance rate α̂", ylim=(0, 1.02),
               title="acceptance")
    ax_speed.legend(fontsize=8)
    ax_acc.legend(fontsize=8)
    fig.suptitle(f"mlx-spec bench · {models} · drafter {result.drafter} · T = {result.params.temperature:g}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as error:
        raise MlxSpecError(f"cannot write {path}: {error.strerror}") from None
    finally:
        plt.close(fig)
