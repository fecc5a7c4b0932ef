"""Options and set-up shared by `generate`, `chat`, `bench` and `serve`: the option types,
the model and sampling flags as one value each (`ModelOptions`, `SamplingOptions`), loading
what `runner.resolve_choice` chose, prompt input.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields
from typing import Annotated, Any, Optional

import typer

from mlx_spec.apps import distributed
from mlx_spec.apps.distributed import world
from mlx_spec.apps.runner import Choice, Gamma, gamma_policy, resolve_choice
from mlx_spec.core.sampling import SamplingParams
from mlx_spec.drafters import DRAFTER_NAMES, DRAFTERS, NO_DRAFTER
from mlx_spec.errors import UsageError
from mlx_spec.progress import StderrProgress
from mlx_spec.prompts import valid_text

# ---------------------------------------------------------------------------------------
# Option types (shared so every command spells them the same way)
# ---------------------------------------------------------------------------------------

MODELS = "Models"
SAMPLING = "Sampling"
OUTPUT = "Output"
STRUCTURED = "Structured output"

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", rich_help_panel=MODELS, metavar="MODEL",
    help="Target model p: a local mlx-lm folder, a .gguf file, a Hugging Face id, a model in "
         "Ollama's store (ollama:NAME[:TAG]; its model file's draft and γ become the defaults) or "
         "LM Studio's folder (lmstudio:PUB/MODEL), or 'default' (the embedded Gemma 3 270M). "
         "Overrides the preset's target. `mlx-spec models list --local` shows what is on disk.")]
DraftOpt = Annotated[Optional[str], typer.Option(
    "--draft-model", "-d", rich_help_panel=MODELS, metavar="MODEL",
    help="Draft model q (same tokenizer as the target), in any form --model takes; "
         "ollama:NAME#draft is an Ollama model's own draft layer. Overrides the preset's draft.")]
DrafterOpt = Annotated[Optional[str], typer.Option(
    "--drafter", rich_help_panel=MODELS, metavar="NAME",
    help="Who drafts: " + ", ".join(f"'{name}' ({cls.summary})" for name, cls in DRAFTERS.items())
         + f" or '{NO_DRAFTER}' (plain decoding). Default: the preset's, else mtp when the draft is an "
         "assistant checkpoint, model for another draft, else suffix.")]
PresetOpt = Annotated[Optional[str], typer.Option(
    "--preset", rich_help_panel=MODELS, metavar="NAME",
    help="A named target + draft pair with default γ and sampling (see `mlx-spec models list`). "
         "Used as 'default' when no --model is given.")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", rich_help_panel=MODELS, metavar="DTYPE",
    help="Dtype of all floating-point parameters: float32, float16 or bfloat16. Default: float32 on "
         "CPU, bfloat16 on a GPU.")]
QuantizeOpt = Annotated[Optional[int], typer.Option(
    "--quantize", "-q", rich_help_panel=MODELS, min=2, max=8, metavar="BITS",
    help="Quantize both models to this many bits on load (4 or 8 are usual).")]
DraftQuantizeOpt = Annotated[Optional[int], typer.Option(
    "--draft-quantize", rich_help_panel=MODELS, min=2, max=8, metavar="BITS",
    help="Quantize only the draft model to this many bits; e.g. the target's own 4-bit copy "
         "as its draft: -m default -d default --draft-quantize 4.")]
GroupSizeOpt = Annotated[Optional[int], typer.Option(
    "--q-group-size", rich_help_panel=MODELS, metavar="32|64|128",
    help="Group size for --quantize / --draft-quantize (weights sharing one scale). Default: 64.")]
KvBitsOpt = Annotated[Optional[int], typer.Option(
    "--kv-bits", rich_help_panel=MODELS, metavar="8|4",
    help="Quantize the target's KV cache to this many bits (sliding-window layers too): 8 bits "
         "take 0.53x the memory of a bfloat16 cache (0.28x of a float32 one), 4 bits 0.28x "
         "(0.16x), at some cost in quality (docs/kv-cache.md); attention runs on it through "
         "quantized matmuls and speculation stays exact (output as plain decoding with the "
         "same --kv-bits). Default: full precision.")]
KvGroupSizeOpt = Annotated[Optional[int], typer.Option(
    "--kv-group-size", rich_help_panel=MODELS, metavar="32|64|128",
    help="Group size for --kv-bits / --draft-kv-bits: values and window layers' keys sharing "
         "one scale along the head (it must divide the models' head size), global layers' keys "
         "along positions (docs/kv-cache.md). Default: 64.")]
KvStartOpt = Annotated[Optional[int], typer.Option(
    "--kv-start", rich_help_panel=MODELS, metavar="N",
    help="Keep the KV cache in full precision until a conversation holds N tokens, then "
         "quantize all of it, as mlx-lm's quantized_kv_start. Default: 0 (from the start).")]
DraftKvBitsOpt = Annotated[Optional[int], typer.Option(
    "--draft-kv-bits", rich_help_panel=MODELS, metavar="8|4",
    help="Quantize the draft model's KV cache to this many bits (--kv-group-size and "
         "--kv-start apply too). Default: full precision.")]
DraftOnOpt = Annotated[Optional[str], typer.Option(
    "--draft-on", rich_help_panel=MODELS, metavar="root|all",
    help="Across machines (under mlx.launch): run the draft model on rank 0 and broadcast its "
         "tokens (default), or on every rank, which saves that broadcast but needs identical "
         "machines (every rank must draft bit-identically).")]
GammaOpt = Annotated[Optional[str], typer.Option(
    "--gamma", "-g", rich_help_panel=MODELS, metavar="N|auto|tree",
    help="Draft tokens per round γ: a whole number (0 = plain decoding), 'auto' (chosen each "
         "round from measured costs and live acceptance) or 'tree' (auto, plus draft trees: "
         "several continuations verified in one pass, shaped by the measured cost of width; "
         "the suffix and n-gram drafters branch at earlier matches, a draft model or MTP assistant at "
         "its next likeliest tokens where it is unsure). Default: the preset's, else auto.")]

RecalibrateOpt = Annotated[bool, typer.Option(
    "--recalibrate", rich_help_panel=MODELS,
    help="Measure the cost curve behind γ = auto again instead of reading the cached one "
         "(costs.json in $MLX_SPEC_CACHE, default ~/.cache/mlx-spec); auto γ also corrects it "
         "from every round's measured time while it runs.")]

TempOpt = Annotated[Optional[float], typer.Option(
    "--temp", "-t", rich_help_panel=SAMPLING, min=0.0,
    help="Sampling temperature; 0 is greedy (output identical to the target alone).")]
TopPOpt = Annotated[Optional[float], typer.Option(
    "--top-p", rich_help_panel=SAMPLING, metavar="(0,1]",
    help="Nucleus sampling: keep the likeliest tokens until their probability reaches this "
         "mass; greater than 0, at most 1 (1 = off).")]
TopKOpt = Annotated[Optional[int], typer.Option(
    "--top-k", rich_help_panel=SAMPLING, min=0, help="Keep the k most likely tokens (0 = off).")]
MinPOpt = Annotated[Optional[float], typer.Option(
    "--min-p", rich_help_panel=SAMPLING, metavar="[0,1)",
    help="Drop tokens below min-p times the top probability; at least 0, below 1 (0 = off).")]
RepPenaltyOpt = Annotated[Optional[float], typer.Option(
    "--repetition-penalty", rich_help_panel=SAMPLING, min=0.0,
    help="Penalty for recently seen tokens (1 = off).")]
SeedOpt = Annotated[Optional[int], typer.Option(
    "--seed", "-s", rich_help_panel=SAMPLING, metavar="0..2^64-1",
    help="PRNG seed; the same seed reproduces a sampled run (γ auto then learns nothing "
         "from round times, which vary with load).")]
MaxTokensOpt = Annotated[int, typer.Option(
    "--max-tokens", "-n", rich_help_panel=SAMPLING, min=1, help="Most tokens to generate.")]
StopOpt = Annotated[Optional[list[str]], typer.Option(
    "--stop", rich_help_panel=SAMPLING, help="A string that ends generation (repeatable).")]
ChatOpt = Annotated[Optional[bool], typer.Option(
    "--chat/--raw", rich_help_panel=SAMPLING,
    help="Wrap the prompt in the model's chat template, or send it as raw text. "
         "Default: chat when the tokenizer has a template, except for base-model presets "
         "such as the embedded default.")]
ThinkOpt = Annotated[Optional[bool], typer.Option(
    "--think/--no-think", rich_help_panel=SAMPLING,
    help="Let the model think before it answers (the chat template's enable_thinking), or "
         "not. Default: the template's own choice (mlx-lm's: on for a model that can think).")]
ImageOpt = Annotated[Optional[list[str]], typer.Option(
    "--image", metavar="PATH", rich_help_panel=SAMPLING,
    help="An image for a model with a vision tower (Gemma 3 4B and up; needs "
         "`pip install 'mlx-spec[vision]'`), placed before the prompt (repeatable). Drafting "
         "stays on: MTP and n-gram draft as usual; a text-only --draft-model sees only the "
         "image's placeholder tokens, so it stays exact but is accepted less often.")]
ChatTemplateOpt = Annotated[Optional[str], typer.Option(
    "--chat-template", metavar="FILE|NAME", rich_help_panel=MODELS,
    help="Chat template replacing the model's own (for a checkpoint with none or a wrong one): "
         "a .jinja file, or a built-in one: gemma3, gemma4, qa (plain 'Question: ... Answer: ...' "
         "text for a base model; the default preset's).")]
JsonSchemaOpt = Annotated[Optional[str], typer.Option(
    "--json-schema", metavar="FILE|JSON", rich_help_panel=STRUCTURED,
    help="Constrain the output to JSON that follows this JSON Schema (a file, or the schema "
         "itself); generation stops when the value is complete. Exact under drafting; tokens "
         "the schema forces (key names, punctuation) are drafted for free.")]
RegexOpt = Annotated[Optional[str], typer.Option(
    "--regex", metavar="PATTERN", rich_help_panel=STRUCTURED,
    help="Constrain the output to text matching this regular expression (the whole output).")]
GrammarOpt = Annotated[Optional[str], typer.Option(
    "--grammar", metavar="FILE", rich_help_panel=STRUCTURED,
    help="Constrain the output to a grammar in llguidance's Lark format (Lark syntax; "
         "'start' is the top rule; terminals may be /regexes/, and %json {...} embeds a JSON "
         "schema).")]
ColorOpt = Annotated[bool, typer.Option(
    "--color-drafts", rich_help_panel=OUTPUT,
    help="Colour text that came from accepted draft tokens (on a terminal).")]


# ---------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------


class _Flags:
    """Options built once per command from its Typer parameters, which carry the fields' names."""

    @classmethod
    def from_flags(cls, flags: dict, **absent):
        """From a command's parameters (its `locals()`); `absent`: the values of the fields
        the command has no flag for. A field that is in neither is a `KeyError`."""
        return cls(**{f.name: absent[f.name] if f.name in absent else flags[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class ModelOptions(_Flags):
    """The model flags (panel "Models") as given, shared by generate, chat, bench and serve;
    None: the preset's value or the loader's default. `setup_models` checks and loads them."""

    model: Optional[str] = None
    draft_model: Optional[str] = None
    drafter: Optional[str] = None
    preset: Optional[str] = None
    gamma: Optional[str] = None  # --gamma's text: parsed once, by `runner.resolve_choice`
    dtype: Optional[str] = None
    quantize: Optional[int] = None
    draft_quantize: Optional[int] = None
    group_size: Optional[int] = None
    draft_on: Optional[str] = None  # under mlx.launch: "root" or "all" (`distributed.load_pair`)
    chat_template: Optional[str] = None  # a built-in template's name or a file
    kv_bits: Optional[int] = None  # kv_bits … draft_kv_bits: the caches' K/V quantization
    kv_group_size: Optional[int] = None
    kv_start: Optional[int] = None
    draft_kv_bits: Optional[int] = None


@dataclass(frozen=True)
class SamplingOptions(_Flags):
    """The sampling flags as given; None: the preset's default, else `SamplingParams`'s."""

    temp: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None

    def params(self, preset) -> SamplingParams:
        """Flags over the preset's sampling defaults over `SamplingParams()`'s."""
        base = SamplingParams()

        def pick(flag, name):
            if flag is not None:
                return flag
            value = getattr(preset, name, None) if preset is not None else None
            return getattr(base, name) if value is None else value

        return SamplingParams(
            temperature=pick(self.temp, "temperature"),
            top_k=pick(self.top_k, "top_k"),
            top_p=pick(self.top_p, "top_p"),
            min_p=pick(self.min_p, "min_p"),
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            seed=self.seed,
        )


@dataclass
class Setup:
    """What the flags and the preset resolved to (`runner.Choice`), the sampling
    parameters, and the loaded pair."""

    choice: Choice
    params: SamplingParams
    pair: Any  # mlx_spec.loading.ModelPair
    kv: Any = None  # mlx_spec.core.cache.KVQuantization for the target's cache, or None
    draft_kv: Any = None  # and for the draft model's
    template_stops: tuple = ()  # stop strings the chat template in use needs (chat_templates.TEMPLATE_STOPS)

    @property
    def engine_options(self) -> dict:
        """`build_engine` keywords from the flags: the caches' K/V quantization."""
        return {"kv": self.kv, "draft_kv": self.draft_kv}

    def __getattr__(self, name):  # preset, target, draft, drafter, gamma (a `Gamma`), models
        return getattr(self.choice, name)


def setup_models(
    models: ModelOptions,
    sampling: Optional[SamplingOptions] = None,
    *,
    preset_sampling: bool = True,
    chat: Optional[bool | str] = None,
    preset_template: bool = False,
) -> Setup:
    """Resolve preset and flags and check everything that can be checked without a model
    (γ, sampling values, model paths), then load the pair (the loader shows progress).

    Args:
        models: the model flags; sampling: the sampling flags (None: none given);
            `preset_sampling`: whether the preset's sampling defaults apply under them.
        chat: --chat/--raw, or True for a command that always chats ("later" for one
            that renders its first template only once the user has typed): with the
            preset's choice (`use_chat`) it says whether to load the tokenizer that renders
            chat templates at once (`load_model(for_chat=...)`).
        preset_template: whether the preset's chat template (a base model's plain "qa")
            replaces the model's where --chat-template names none: for the terminal chat,
            whose stop strings end its answers (`Setup.template_stops`); a server's clients
            send their own stops, so serve keeps the model's template.
    """
    from mlx_spec.loading import check_source, load_pair
    from mlx_spec.loading.chat_templates import TEMPLATE_STOPS, chat_template_text
    from mlx_spec.loading.loader import check_bits

    w = world()
    with w.together():  # across ranks: a bad flag or path on any rank ends every rank here
        choice = resolve_choice(model=models.model, draft_model=models.draft_model, drafter=models.drafter,
                                preset=models.preset, gamma=models.gamma)
        params = (sampling or SamplingOptions()).params(choice.preset if preset_sampling else None)
        if models.group_size is not None and models.quantize is None and models.draft_quantize is None:
            raise UsageError("--q-group-size applies to quantization: add --quantize or --draft-quantize")
        check_bits(models.quantize, "--quantize")
        check_bits(models.draft_quantize, "--draft-quantize")  # else checked only once the target has loaded
        kv, draft_kv = kv_quantization(models.kv_bits, models.kv_group_size, models.kv_start, models.draft_kv_bits)
        if models.draft_on is not None and models.draft_on not in distributed.DRAFT_ON:
            raise UsageError(f"--draft-on must be root or all, not {models.draft_on!r}")
        check_source(choice.target, "target model", as_target=True)
        template_name = models.chat_template or (getattr(choice.preset, "chat_template", None)
                                                 if preset_template else None)
        template = chat_template_text(template_name) if template_name is not None else None
        if choice.draft is not None:
            check_source(choice.draft, "draft model")
    kwargs = {k: v for k, v in (("dtype", models.dtype), ("quantize", models.quantize),
                                ("group_size", models.group_size)) if v is not None}
    if chat is None:  # as use_chat decides once the tokenizer is loaded
        chat = getattr(choice.preset, "chat", True) if choice.preset is not None else True
    if chat:
        kwargs["for_chat"] = "later" if chat == "later" else True
    if template is not None:
        kwargs["chat_template"] = template
    draft_options = {"quantize": models.draft_quantize} if models.draft_quantize is not None else None
    if w.active:  # launched by mlx.launch: the target sharded over the ranks
        pair = distributed.load_pair(w, choice.target, choice.draft, draft_on=models.draft_on or "root",
                                     progress=w.is_root, draft_options=draft_options, **kwargs)
    else:
        pair = load_pair(choice.target, choice.draft, progress=True, draft_options=draft_options, **kwargs)
    return Setup(choice, params, pair, kv, draft_kv, TEMPLATE_STOPS.get(template_name, ()))


KV_BITS = (4, 8)


def kv_quantization(bits: Optional[int], group_size: Optional[int], start: Optional[int],
                    draft_bits: Optional[int]):
    """(target's, draft's) `KVQuantization` or None from --kv-bits, --kv-group-size,
    --kv-start and --draft-kv-bits; a `UsageError` for a value that cannot work."""
    from mlx_spec.core.cache.layers import KVQuantization
    from mlx_spec.loading.loader import GROUP_SIZES

    for value, flag in ((bits, "--kv-bits"), (draft_bits, "--draft-kv-bits")):
        if value is not None and value not in KV_BITS:
            raise UsageError(f"{flag} must be 8 or 4, not {value}")
    if bits is None and draft_bits is None and (group_size is not None or start is not None):
        raise UsageError("--kv-group-size and --kv-start apply to a quantized KV cache: add --kv-bits "
                         "or --draft-kv-bits")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise UsageError(f"--kv-group-size must be one of {', '.join(map(str, GROUP_SIZES))}, not {group_size}")
    if start is not None and start < 0:
        raise UsageError(f"--kv-start must be 0 or more, not {start}")
    options = {"group_size": group_size or 64, "start": start or 0}
    return tuple(None if b is None else KVQuantization(b, **options) for b in (bits, draft_bits))


def refuse_thinking_with_grammar(think: Optional[bool], json_schema, regex, grammar) -> None:
    """--think with --json-schema / --regex / --grammar is a usage error, before any load:
    the grammar holds from the first token, so the thought would be forced into the
    answer's shape or not be written."""
    flag = next((f for f, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar))
                 if v is not None), None)
    if think and flag is not None:
        raise UsageError(f"{flag} cannot be combined with --think yet: the grammar would hold from "
                         "the first token, the thought's")


def structured_output(setup: "Setup", engine, json_schema: Optional[str] = None, regex: Optional[str] = None,
                      grammar: Optional[str] = None):
    """From --json-schema / --regex / --grammar (at most one) to a function giving each
    generation its own grammar `Matcher`, or None when none was given. A schema or grammar
    that does not compile is a one-line usage error naming the flag and the feature."""
    from mlx_spec.core.grammar import compile_grammar, read_grammar_option

    given = [(flag, kind, value) for flag, kind, value in (
        ("--json-schema", "json_schema", json_schema), ("--regex", "regex", regex), ("--grammar", "lark", grammar))
        if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise UsageError(f"give one of {', '.join(flag for flag, _, _ in given)}, not several")
    flag, kind, value = given[0]
    source = value if kind == "regex" else read_grammar_option(value, kind)
    try:
        compiled = compile_grammar(setup.pair.tokenizer, kind, source, engine.eos_ids)
    except UsageError as e:
        raise UsageError(str(e), flag=flag) from None
    return lambda: compiled.matcher(engine.eos_ids)


def template_kwargs(think: Optional[bool], chat: bool) -> dict:
    """The chat template's variables for --think/--no-think (none when not given)."""
    if think is None:
        return {}
    if not chat:
        raise UsageError("--think/--no-think switches the chat template's thinking, so it "
                         "needs --chat")
    return {"enable_thinking": think}


def thought_splitter(tokenizer, chat: bool, prompt_ids: list[int]):
    """A `ThoughtSplitter` for an answer to `prompt_ids`: a chat's thoughts (in the model's
    markers) apart from its answer; raw text is all answer."""
    from mlx_spec.apps.thinking import ThoughtSplitter, opens_thought, think_syntax

    syntax = think_syntax(tokenizer) if chat else None
    return ThoughtSplitter(syntax, opens_thought(tokenizer, syntax, prompt_ids))


def use_chat(tokenizer, chat: Optional[bool], preset=None) -> bool:
    """--chat/--raw if given, else the preset's choice (False for base models), and only
    when the tokenizer has a template."""
    if chat is not None:
        return chat
    wanted = getattr(preset, "chat", True) if preset is not None else True
    return wanted and bool(getattr(tokenizer, "chat_template", None))


# ---------------------------------------------------------------------------------------
# Input and progress
# ---------------------------------------------------------------------------------------


def image_prompt(target, tokenizer, text: str, chat: bool, kwargs: dict, images: list, flag: str):
    """(prompt ids, `ImagePrompt` or None) for `text` with `images` (PIL images) before it:
    in the chat template's image parts, or raw, after one placeholder per image. A target
    without a vision tower refuses images in one line naming `flag`."""
    from mlx_spec.apps.stream import encode_prompt

    if not images:
        return encode_prompt(tokenizer, text, chat, kwargs), None
    if target.vision is None:
        raise UsageError(f"{target.source} reads no images (it has no vision tower)", flag=flag)
    prompter = target.vision.prompter
    if not chat:
        text = prompter.placeholder * len(images) + text
    prompt = prompter.prompt(encode_prompt(tokenizer, text, chat, kwargs, images=len(images) if chat else 0), images)
    return prompt.ids, prompt



def read_prompt(prompt: Optional[str]) -> str:
    """The prompt argument, or stdin when it is '-' or absent and stdin is not a terminal.
    Bytes that are not UTF-8 become U+FFFD, with a warning. Across ranks, rank 0 reads it
    and the others receive it."""
    w = world()
    if not w.active:
        return _read_prompt(prompt)
    with w.together():
        text = _read_prompt(prompt) if w.is_root else None
    return w.broadcast_text(text)


def _read_prompt(prompt: Optional[str]) -> str:
    if prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise UsageError("no prompt: give PROMPT as an argument or pipe text on stdin")
        stdin = getattr(sys.stdin, "buffer", None)
        prompt = stdin.read() if stdin is not None else sys.stdin.read()
    prompt = checked_text(prompt, "the prompt")
    if not prompt.strip():
        raise UsageError("the prompt is empty")
    return prompt


def checked_text(text, what: str) -> str:
    """`valid_text`, warning on stderr when something had to be replaced."""
    text, replaced = valid_text(text)
    warn_replaced(replaced, what)
    return text


def warn_replaced(replaced: int, what: str) -> None:
    if replaced == 1:
        print(f"warning: {what} had 1 byte that is not valid UTF-8; it became U+FFFD", file=sys.stderr)
    elif replaced:
        print(f"warning: {what} had {replaced} bytes that are not valid UTF-8; each became U+FFFD",
              file=sys.stderr)


def calibrate_gamma(engine, gamma: Gamma, context: int, name: str = "--gamma",
                    reproducible: bool = False):
    """The γ policy; 'auto' may first measure the cost curve (seconds, with progress).
    `reproducible`: a seeded sample (see `runner.gamma_policy`)."""
    with StderrProgress() as progress:
        return gamma_policy(gamma, engine, context=context, name=name, reproducible=reproducible,
                            progress=progress.task("calibrating the cost curve for γ = auto"))
