"""`mlx-spec generate`: one prompt, one answer.

On a terminal the text streams above a live stats panel; piped, stdout gets only the text
and stderr one summary line; `--json` prints one JSON object. A chat answer's thought
(`--think`) is shown dimmed before the answer on a terminal; piped, it goes to stderr, so
stdout holds the answer alone, as a script reading it expects (`> file`, `| jq`), while
whoever watches still sees the model think; `--json` has it as "reasoning".
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import mlx.core as mx
import typer

from mlx_spec.apps import calibration
from mlx_spec.apps.distributed import world
from mlx_spec.apps.runner import Gamma, build_engine
from mlx_spec.apps.stream import encode_prompt, stream_generate
from mlx_spec.apps.thinking import PhaseAcceptance
from mlx_spec.cli.app import app
from mlx_spec.cli.common import (
    OUTPUT,
    ChatOpt,
    ChatTemplateOpt,
    ColorOpt,
    DrafterOpt,
    DraftKvBitsOpt,
    DraftOnOpt,
    DraftOpt,
    DraftQuantizeOpt,
    DtypeOpt,
    GammaOpt,
    GrammarOpt,
    GroupSizeOpt,
    ImageOpt,
    JsonSchemaOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    KvStartOpt,
    MaxTokensOpt,
    MinPOpt,
    ModelOpt,
    ModelOptions,
    PresetOpt,
    QuantizeOpt,
    RecalibrateOpt,
    RegexOpt,
    RepPenaltyOpt,
    SamplingOptions,
    SeedOpt,
    StopOpt,
    TempOpt,
    ThinkOpt,
    TopKOpt,
    TopPOpt,
    calibrate_gamma,
    image_prompt,
    read_prompt,
    refuse_thinking_with_grammar,
    setup_models,
    structured_output,
    template_kwargs,
    thought_splitter,
    use_chat,
)
from mlx_spec.cli.render import ViewMaker, render_stats, summary_line
from mlx_spec.core.stats import Stats
from mlx_spec.errors import MlxSpecError, UsageError
from mlx_spec.models.vision import read_image_file
from mlx_spec.progress import StderrProgress
from mlx_spec.runtime import blas

REFRESH_S = 0.1  # live panel refresh throttle
DRAFT_STYLE = "green"
THOUGHT_STYLE = "dim"


@app.command()
def generate(
    prompt: Annotated[Optional[str], typer.Argument(
        help="The prompt. Read from stdin when omitted (or '-').", show_default=False)] = None,
    model: ModelOpt = None,
    draft_model: DraftOpt = None,
    drafter: DrafterOpt = None,
    preset: PresetOpt = None,
    gamma: GammaOpt = None,
    recalibrate: RecalibrateOpt = False,
    dtype: DtypeOpt = None,
    quantize: QuantizeOpt = None,
    draft_quantize: DraftQuantizeOpt = None,
    draft_on: DraftOnOpt = None,
    group_size: GroupSizeOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    kv_start: KvStartOpt = None,
    draft_kv_bits: DraftKvBitsOpt = None,
    temp: TempOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    repetition_penalty: RepPenaltyOpt = None,
    seed: SeedOpt = None,
    max_tokens: MaxTokensOpt = 256,
    stop: StopOpt = None,
    chat: ChatOpt = None,
    think: ThinkOpt = None,
    chat_template: ChatTemplateOpt = None,
    image: ImageOpt = None,
    json_schema: JsonSchemaOpt = None,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    color_drafts: ColorOpt = False,
    prompt_cache: Annotated[Optional[Path], typer.Option(
        "--prompt-cache", metavar="FILE",
        help="mlx-lm's prompt cache file (mlx_lm.cache_prompt's layout). If FILE exists, the "
             "prompt continues the context it holds, as with mlx_lm.generate "
             "--prompt-cache-file (with a chat template: the rest of the user message it "
             "holds open). If not, the prompt is cached into FILE first, as mlx_lm.cache_prompt "
             "does, then answered. Refused if made with another model.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", rich_help_panel=OUTPUT, help="Print one JSON object: text, finish reason, models, "
        "sampling and all statistics.")] = False,
) -> None:
    """Generate text for one prompt with speculative decoding.

    Examples:  mlx-spec generate "Why is the sky blue?"  ·  echo "Once upon" | mlx-spec generate --raw
    ·  mlx-spec generate "An address in Paris:" --json-schema address.json
    """
    text = read_prompt(prompt)
    refuse_thinking_with_grammar(think, json_schema, regex, grammar)
    images = [read_image_file(path, "--image") for path in image or ()]  # refused before any load
    if images and prompt_cache is not None:  # mlx-lm's layout keys positions by id, not by image
        raise UsageError("an image prompt cannot be kept in an mlx-lm prompt cache file", flag="--prompt-cache")
    if kv_bits is not None and prompt_cache is not None:  # mlx-lm's layout has no quantized windows
        raise UsageError("--kv-bits caches cannot be kept in an mlx-lm prompt cache file", flag="--prompt-cache")
    calibration.recalibrate(recalibrate)
    setup = setup_models(ModelOptions.from_flags(locals()), SamplingOptions.from_flags(locals()), chat=chat)
    params = setup.params
    engine = build_engine(setup.pair, setup.drafter, **setup.engine_options)
    constrained = structured_output(setup, engine, json_schema, regex, grammar)
    tokenizer = setup.pair.tokenizer
    # A template given on the command line is meant to be used, a base-model preset or not.
    chat = use_chat(tokenizer, True if chat is None and chat_template else chat, setup.preset)
    cache = None
    if prompt_cache is not None:
        cache, prompt_ids, real_ids = cached_prompt(prompt_cache, engine, setup, text, chat,
                                                    template_kwargs(think, chat), params)
        images = None
    else:
        prompt_ids, images = image_prompt(setup.pair.target, tokenizer, text, chat, template_kwargs(think, chat),
                                          images, "--image")
        real_ids = prompt_ids
    splitter = thought_splitter(tokenizer, chat, real_ids)
    engine.check_prompt(prompt_ids)  # before calibration, which takes seconds
    gamma_mode = setup.gamma if engine.drafter is not None else Gamma.OFF
    policy = calibrate_gamma(engine, gamma_mode, len(prompt_ids), reproducible=params.seed is not None)
    views = ViewMaker(engine, policy, gamma_mode)
    stats = Stats()

    def responses(prefill_progress=None):
        return stream_generate(engine, tokenizer, prompt_ids, params, gamma=policy,
                               max_tokens=max_tokens, stop=stop or (), stats=stats,
                               prefill_progress=prefill_progress, images=images, prompt_cache=cache,
                               constraint=constrained() if constrained else None)

    if json_out:
        with StderrProgress(_bars_only()) as progress:
            thoughts, pieces, finish, phases = [], [], None, PhaseAcceptance()
            try:
                for response in responses(progress.task("prefill")):
                    phases.observe(splitter.thinking, response.round.gamma, response.round.accepted)
                    thought, answer = splitter.feed(response.text)
                    thoughts.append(thought)
                    pieces.append(answer)
                    finish = response.finish_reason
            except KeyboardInterrupt:
                finish = "interrupted"
            thought, answer = splitter.finish()
        view = views(stats, interrupted=finish == "interrupted")
        out = {
            "text": "".join(pieces) + answer,
            "reasoning": "".join(thoughts) + thought,
            "finish_reason": finish,
            "prompt_tokens": len(prompt_ids),
            "generated_tokens": stats.generated,
            "models": setup.models,
            "drafter": views.drafter,
            "gamma": gamma_mode.value,
            "chat": chat,
            "ranks": world().size,  # > 1: the target sharded across ranks (mlx.launch)
            "device": str(mx.default_device()),
            "blas": blas.describe(),  # what MLX's CPU matmuls ran with (and how many threads)
            "sampling": asdict(params),
            "stats": {**stats.as_dict(), **view.as_dict(), **phases.as_dict()},
        }
        print(json.dumps(out, ensure_ascii=False))
        interrupted = view.interrupted
    elif sys.stdout.isatty():
        interrupted = _live(responses, views, stats, color_drafts, splitter)
    else:
        interrupted = _piped(responses, views, stats, splitter)
    if interrupted:
        raise typer.Exit(130)  # what a shell reports for Ctrl-C


def cached_prompt(path: Path, engine, setup, text: str, chat: bool, template_kwargs: dict, params):
    """(the PromptCache, the prompt's ids, those of them whose ids are known) for
    --prompt-cache FILE: FILE's cache and the prompt after it, or the prompt cached into
    FILE first. A file mlx-lm made does not say the ids it holds: the draft model cannot
    prefill its own cache from them, so that answer is drafted without it."""
    from mlx_spec.cache.files import CacheFileError, cache_key
    from mlx_spec.cache.mlx_lm_files import (
        continuation_ids,
        load_mlx_lm_cache,
        open_prompt_ids,
        save_mlx_lm_cache,
    )
    from mlx_spec.drafters.model import ModelDrafter

    if world().active:
        raise MlxSpecError("--prompt-cache does not run across ranks (mlx.launch): each rank holds "
                           "a part of the cache")
    tokenizer = setup.pair.tokenizer
    key = cache_key(engine, tokenizer)
    if not path.exists():
        cache = engine.make_prompt_cache()
        cache.target.prefill(open_prompt_ids(tokenizer, text, chat, template_kwargs), engine.prefill_chunk)
        try:
            # the model as mlx-lm would load it: an imported one (GGUF, Ollama…) by its folder
            loaded = setup.pair.target
            save_mlx_lm_cache(path, cache.target, key,
                              setup.target if loaded.kind in ("hf", "local") else str(loaded.path))
        except OSError as error:  # a full disk costs the cache file, not the answer
            print(f"warning: could not write --prompt-cache {path}: {error.strerror or error}", file=sys.stderr)
        prompt_ids = encode_prompt(tokenizer, text, chat, template_kwargs)
        return cache, prompt_ids, prompt_ids
    try:
        cache, ids = load_mlx_lm_cache(path, engine, key, (setup.target, str(setup.pair.target.path)))
    except CacheFileError as error:
        raise MlxSpecError(f"--prompt-cache: {error}") from None
    rest = continuation_ids(tokenizer, text, chat, template_kwargs)
    if not rest:
        raise MlxSpecError("--prompt-cache: the prompt adds nothing to the cached one")
    if ids is None:
        if params.penalized:
            raise MlxSpecError("--prompt-cache: the file (made by mlx-lm) does not say which tokens "
                               "it holds, which the repetition penalty needs")
        if isinstance(engine.drafter, ModelDrafter):
            engine.drafter = None
            print("note: the --prompt-cache file holds no token ids (made by mlx-lm), so the draft "
                  "model cannot start from it: decoding without it", file=sys.stderr)
    return cache, cache.target.ids + rest, (ids or []) + rest


def _bars_only() -> str:
    """Prefill progress: a bar on a terminal; piped, stderr keeps its one summary line."""
    return "bars" if sys.stderr.isatty() else "off"


def _piped(responses, views, stats, splitter) -> bool:
    """Plain text on stdout as it comes, a thought on stderr (dimmed on a terminal); one
    summary line on stderr; no control codes on a pipe. Returns whether Ctrl-C stopped it."""
    interrupted, ended_line, thought_line = False, True, True
    dim = ("\x1b[2m", "\x1b[0m") if sys.stderr.isatty() else ("", "")

    def show(thought: str, answer: str) -> None:
        nonlocal ended_line, thought_line
        if thought:
            sys.stderr.write(dim[0] + thought + dim[1])
            sys.stderr.flush()
            thought_line = thought.endswith("\n")
        if answer:
            sys.stdout.write(answer)
            sys.stdout.flush()
            ended_line = answer.endswith("\n")

    with StderrProgress(_bars_only()) as progress:
        try:
            for response in responses(progress.task("prefill")):
                show(*splitter.feed(response.text))
        except KeyboardInterrupt:
            interrupted = True
    show(*splitter.finish())
    if not thought_line:
        sys.stderr.write("\n")
    if not ended_line:
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary_line(views(stats, interrupted)), file=sys.stderr)
    return interrupted


def _live(responses, views, stats, color_drafts: bool, splitter) -> bool:
    """Streamed text above a live stats panel. Completed screen rows are printed above the
    panel (they scroll normally); the row in progress stays inside the live region.
    Returns whether Ctrl-C stopped it."""
    from rich.cells import chop_cells
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    console = Console()
    tail = Text()
    prefill = {"done": 0, "total": 0}
    interrupted = thinking = False

    def frame(final: bool = False):
        if not stats.rounds and not final:  # before the first token there is nothing to show
            done = f" {prefill['done']}/{prefill['total']} tokens" if prefill["total"] else ""
            return Text(f"prefilling{done}…", style="dim")
        panel = render_stats(views(stats, interrupted))
        return Group(tail, panel) if tail.plain else panel

    with Live(frame(), console=console, auto_refresh=False, transient=False) as live:
        last = 0.0

        def on_prefill(done, total):
            nonlocal last
            prefill.update(done=done, total=total)
            if time.monotonic() - last > REFRESH_S:
                live.update(frame(), refresh=True)
                last = time.monotonic()

        try:
            for response in responses(on_prefill):
                pieces = [(*splitter.feed(piece), from_draft) for piece, from_draft in response.segments()]
                if response.finish_reason:
                    pieces.append((*splitter.finish(), False))
                for thought, answer, from_draft in pieces:
                    style = DRAFT_STYLE if (color_drafts and from_draft) else None
                    if thought:
                        tail.append(thought, style=THOUGHT_STYLE if style is None else f"{THOUGHT_STYLE} {style}")
                        thinking = True
                    if answer and thinking:  # the answer starts below the thought
                        tail.append("\n\n")
                        thinking = False
                    tail.append(answer, style=style)
                # Move finished rows (explicit newlines, or full terminal rows) out of the live region.
                if "\n" in tail.plain:
                    cut = tail.plain.rindex("\n")
                    live.console.print(tail[:cut], soft_wrap=True)
                    tail = tail[cut + 1 :]
                rows = chop_cells(tail.plain, max(console.width, 20))
                if len(rows) > 2:  # a long paragraph: print its full rows one by one, as a terminal wraps
                    for row in rows[:-1]:
                        live.console.print(tail[: len(row)], no_wrap=True, overflow="ignore")
                        tail = tail[len(row) :]
                if time.monotonic() - last > REFRESH_S or response.finish_reason:
                    live.update(frame(), refresh=True)
                    last = time.monotonic()
        except KeyboardInterrupt:
            interrupted = True
        live.update(frame(final=True), refresh=True)
    return interrupted
