"""From flags and loaded models to a running engine: resolve presets, choose the drafter and
the γ policy.

The CLI, the server and the benchmarks build engines here, so `--preset`, `--drafter` and
`--gamma auto` mean the same thing everywhere, and everything here can be tested without
Typer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Optional, Union

from mlx_spec.apps.calibration import BATCH_WIDTH, load_or_measure
from mlx_spec.apps.distributed import world
from mlx_spec.apps.distributed import world as this_world
from mlx_spec.core.cache.forward import attention_layers
from mlx_spec.core.cache.layers import KVQuantization
from mlx_spec.core.engine import Engine
from mlx_spec.core.policy import MAX_GAMMA, AutoGamma, FixedGamma, GammaPolicy, TreePolicy
from mlx_spec.drafters import DRAFTER_NAMES, NO_DRAFTER, drafter_class
from mlx_spec.errors import MlxSpecError, UsageError
from mlx_spec.loading import get_preset
from mlx_spec.loading.loader import GROUP_SIZES
from mlx_spec.loading.stores import drafting_defaults as store_drafting
from mlx_spec.models.drafts import draft_family

MAX_AUTO_GAMMA = 6
AUTO = "auto"  # --gamma auto: γ chosen each round from the cost curve (`AutoGamma`)
TREE = "tree"  # --gamma tree: draft trees shaped by the cost curve (`TreePolicy`)
TREE_NODES = 12  # the most nodes a draft tree keeps; its cost curve is measured that wide
TREE_BRANCHES = 4  # continuations a branching drafter is asked for


@dataclass(frozen=True, eq=False)
class Gamma:
    """γ, the draft tokens per round, as the user set it: a whole number (0: plain
    decoding), "auto" or "tree".

    Parsed once where it comes in (a flag, a preset, an Ollama model file, the server's
    options: `Gamma.parse`) and carried as it is to `gamma_policy`. `fixed` is the number,
    None for "auto" and "tree"; `str()` is what the user typed ("auto", "3") and `value`
    what --json shows ("auto", 3). A Gamma equals (and hashes as) its value, so
    `gamma == 0` reads as it says.
    """

    value: Union[int, str]

    OFF: ClassVar["Gamma"]  # γ = 0: drafting off

    def __post_init__(self):
        if not (self.value in (AUTO, TREE) or (type(self.value) is int and self.value >= 0)):
            raise ValueError(f"γ is a whole number, {AUTO!r} or {TREE!r}, not {self.value!r}")

    @classmethod
    def parse(cls, value: Union["Gamma", int, str], *, name: str = "--gamma", minimum: int = 0,
              limit: int = MAX_GAMMA) -> "Gamma":
        """'auto', 'tree', or a whole number in [minimum, limit] (text or a number; a Gamma
        is only checked against the bounds); anything else is a one-line `UsageError` that
        names the flag or command (`name`) the user typed."""
        if isinstance(value, Gamma):
            value = value.value
        if value in (AUTO, TREE):
            return cls(value)
        try:
            gamma = int(value)
        except (TypeError, ValueError):
            raise UsageError(f"{name} must be a whole number or 'auto' (or 'tree'), not {value!r}") from None
        if not minimum <= gamma <= limit:
            raise UsageError(f"{name} must be between {minimum} and {limit}, or 'auto' (got {gamma})")
        return cls(gamma)

    @property
    def fixed(self) -> Optional[int]:
        """The draft tokens of every round, or None when a policy chooses ("auto", "tree")."""
        return self.value if isinstance(self.value, int) else None

    @property
    def auto(self) -> bool:
        return self.value == AUTO

    @property
    def tree(self) -> bool:
        return self.value == TREE

    def __str__(self) -> str:
        return str(self.value)

    def __eq__(self, other) -> bool:
        return self.value == (other.value if isinstance(other, Gamma) else other)

    def __hash__(self) -> int:
        return hash(self.value)


Gamma.OFF = Gamma(0)


@dataclass
class Choice:
    """What a preset and the flags resolve to, before anything is loaded.

    Attributes:
        preset: the `Preset` used for defaults, or None.
        target: the target model's source; draft: the draft model's, or None.
        drafter: "model" | "mtp" | "suffix" | "ngram" | "none", or None for `build_engine`'s default
            (which tells an MTP assistant from another draft model once it is loaded).
        gamma: the `Gamma` from the flag, else the model file's or the preset's (auto
            when neither says); 0 for drafter "none".
    """

    preset: Any
    target: str
    draft: Optional[str]
    drafter: Optional[str]
    gamma: Gamma

    @property
    def models(self) -> dict:
        return {"target": self.target, "draft": self.draft, "preset": getattr(self.preset, "name", None)}


def _preset_value(preset, name: str, default=None):
    value = getattr(preset, name, None) if preset is not None else None
    return default if value is None else value


def resolve_choice(*, model: Optional[str] = None, draft_model: Optional[str] = None,
                   drafter: Optional[str] = None, preset: Optional[str] = None,
                   gamma: Optional[str] = None) -> Choice:
    """Presets supply defaults and flags override them; with no --model and no --preset the
    "default" preset (the embedded Gemma 3 270M) is used. An explicit --draft-model means
    drafting with it (as "mtp" if it is a Gemma 4 MTP assistant checkpoint, else "model":
    decided by `build_engine` once it is loaded); a model-free drafter loads no draft model.
    An Ollama model (`-m ollama:NAME`) whose model file has a draft drafts with it, at the
    model file's γ (draft_num_predict), unless the flags say otherwise."""

    if drafter is not None:
        drafter_class(drafter)  # a one-line error for a name no drafter has
    if gamma is not None:
        gamma = Gamma.parse(gamma)
    chosen = get_preset(preset or "default") if (preset or model is None) else None
    target = model or _preset_value(chosen, "target", "default")
    draft = draft_model if draft_model is not None else (
        _preset_value(chosen, "draft") if model is None or preset else None)
    if drafter is None and draft_model is None:
        drafter = _preset_value(chosen, "drafter")
        if drafter is not None:
            _check_preset_drafter(chosen)
    # None: `build_engine` chooses once the models are loaded (perhaps one with a draft)
    loads_draft = drafter is None or _needs_draft_model(drafter)
    store = None
    if model is not None and draft is None and loads_draft:
        store = store_drafting(target)  # an Ollama model file's own draft and γ
        draft = store.draft
    if drafter is not None and loads_draft and not draft:
        raise UsageError(f"--drafter {drafter} needs a draft model: give --draft-model or a preset with one")
    if not loads_draft:
        draft = None  # no need to load (or hold in memory) a draft model that will not draft
    if gamma is None:
        gamma = Gamma.parse(store.gamma if store is not None and store.gamma is not None
                            else _preset_value(chosen, "gamma", AUTO))
    if drafter == NO_DRAFTER:
        gamma = Gamma.OFF
    return Choice(chosen, str(target), draft, drafter, gamma)


def _needs_draft_model(drafter: str) -> bool:
    chosen = drafter_class(drafter)
    return chosen is not None and chosen.needs_draft_model


def _check_preset_drafter(preset) -> None:
    """A preset's drafter is a registered one, with a draft model where it needs one."""
    try:
        needs = _needs_draft_model(preset.drafter)
    except UsageError:
        raise MlxSpecError(f"preset '{preset.name}': drafter must be one of {DRAFTER_NAMES}") from None
    if needs and not preset.draft:
        raise MlxSpecError(f"preset '{preset.name}': drafter '{preset.drafter}' needs a draft model")


def build_engine(pair, drafter: Optional[str] = None, *, max_gamma: int = MAX_GAMMA, world=None,
                 kv: Optional[KVQuantization] = None, draft_kv: Optional[KVQuantization] = None) -> Engine:
    """An `Engine` for a loaded `ModelPair`.

    Args:
        pair: `mlx_spec.loading.ModelPair` (target, optional draft, tokenizer, vocab widths).
        drafter: "model" (needs pair.draft), "mtp" (needs a Gemma 4 MTP assistant as
            pair.draft), "suffix", "ngram", "none" (or another registered name), or None:
            "mtp" for an assistant, "model" for another draft model, "suffix" without one
            (it never took more target forwards than n-gram on bench/suffix_replay.py's
            answers at auto γ, and drafts from earlier requests too).
        world: the `distributed.World` the target is sharded over (default: this process's).
            Rank 0's verdict is broadcast every round; a draft model loaded on rank 0 only
            drafts there and its tokens are broadcast (`distributed.load_pair`).
        kv, draft_kv: quantize the target's / draft model's K/V cache (None: full precision).
    """
    w = world or this_world()
    if drafter is None:
        # Across ranks with the draft on rank 0, the other ranks know of it by its vocabulary.
        remote_draft = w.active and pair.draft is None and pair.vocab_size_draft is not None
        family = draft_family(pair.draft.config) if pair.draft is not None else None
        drafter = (family if family is not None else
                   "model" if pair.draft is not None or remote_draft else "suffix")
    chosen_class = drafter_class(drafter)
    chosen = None if chosen_class is None else chosen_class.for_pair(pair, w)
    check_kv_group(pair.target.model, kv, "--kv-group-size")
    if chosen is not None and chosen.own_cache and pair.draft is not None:
        check_kv_group(pair.draft.model, draft_kv, "--kv-group-size (for --draft-kv-bits)")
    eos_ids = set(getattr(pair.tokenizer, "eos_token_ids", None) or [])
    return Engine(pair.target.model, chosen, eos_ids=eos_ids, max_gamma=max_gamma,
                  context_length=pair.target.context_length,
                  agree=w.agree_verdict if w.active else None, vision=pair.target.vision,
                  kv=kv, draft_kv=draft_kv)


def check_kv_group(model, kv: Optional[KVQuantization], flag: str) -> None:
    """A `UsageError` unless `kv`'s group size divides every attention layer's head size."""
    if kv is None:
        return

    heads = {getattr(a, "head_dim", 0) for a in attention_layers(model) if a is not None}
    if any(h % kv.group_size for h in heads):
        fits = [str(g) for g in GROUP_SIZES if not any(h % g for h in heads)]
        raise UsageError(f"{flag} {kv.group_size} does not divide the model's head size "
                         f"({', '.join(map(str, sorted(heads)))})"
                         + (f": choose {' or '.join(fits)}" if fits else ""))


def context_bucket(tokens: int) -> int:
    """Cost curves are measured at powers of two from 256 to 4096 tokens of context."""
    bucket = 256
    while bucket < min(tokens, 4096):
        bucket *= 2
    return bucket


def gamma_policy(
    gamma: Union[Gamma, int, str],
    engine: Engine,
    *,
    context: int = 256,
    refresh: bool = False,
    progress: Optional[Callable[[int, int], None]] = None,
    name: str = "--gamma",
    reproducible: bool = False,
    batch=None,
) -> GammaPolicy:
    """`FixedGamma(n)` for a whole number, `AutoGamma` from the measured cost curve for
    "auto" (measured once per pair and machine, then read from the cache), `tree_policy` for
    "tree". `gamma`: a `Gamma`, or (a library caller's) its text or number, parsed here;
    either is checked against the engine's max_gamma. `name`: the flag or command that set
    γ, for error messages.

    `reproducible` (a seeded sample): γ follows the cached cost curve and the acceptance
    seen, never the clock. Learning from round times would make each run's γ choices, and
    with them how each round splits the seed's key, depend on how busy the machine was.
    `batch`: a `policy.BatchShare`, for auto γ chosen for the batch's tokens per second
    (not for a reproducible request: its γ, and so its draws, must not depend on others)."""
    gamma = Gamma.parse(gamma, name=name, limit=engine.max_gamma)
    if gamma.tree:
        return tree_policy(engine, context=context, refresh=refresh, progress=progress,
                           reproducible=reproducible)
    if gamma.fixed is not None:
        return FixedGamma(gamma.fixed)
    if engine.drafter is None:
        return FixedGamma(0)
    max_gamma = auto_gamma_limit(engine)
    draft_model = None if engine.drafter is None else engine.drafter.model
    batch = None if reproducible else batch
    # in a batch, priced up to the rows the batch's forward reaches (a seeded request reads
    # the one-request curve `generate` reads, so it draws what `generate` draws)
    costs = load_or_measure(
        engine.target, draft_model, max_width=max_gamma + 1,
        context=context_bucket(context), refresh=refresh, progress=progress,
        batch_width=BATCH_WIDTH if batch is not None else 0,
    )
    costs = replace(costs, block=engine.drafter.passes_per_block > 0)  # priced per draft forward
    return AutoGamma(costs, max_gamma=max_gamma, learn_costs=_learn_costs(reproducible), batch=batch)


def auto_gamma_limit(engine: Engine) -> int:
    """The largest γ auto γ weighs: MAX_AUTO_GAMMA, or a block drafter's whole block (its
    draft costs one forward whatever γ, so only the verify's width and the acceptance
    measured limit γ)."""
    limit = MAX_AUTO_GAMMA
    if engine.drafter.passes_per_block:
        limit = max(limit, engine.drafter.model.block_size - 1)
    return min(limit, engine.max_gamma)


def _learn_costs(reproducible: bool) -> bool:
    """Whether auto γ may learn from measured round times. Not for a seeded sample, and not
    across ranks: every rank must choose the same γ, and local round times could part them,
    so there the (rank 0's, broadcast) calibration is taken as given."""
    return not (reproducible or world().active)


def tree_policy(engine: Engine, *, context: int = 256, refresh: bool = False,
                progress: Optional[Callable[[int, int], None]] = None,
                reproducible: bool = False) -> GammaPolicy:
    """`TreePolicy` from the cost curve measured up to a tree's width (`TREE_NODES` + 1
    rows). With a drafter that cannot branch it draws chains, as auto γ does.
    `reproducible`: as for `gamma_policy`."""
    if engine.drafter is None:
        return FixedGamma(0)
    draft_model = None if engine.drafter is None else engine.drafter.model
    nodes = min(TREE_NODES, engine.max_gamma)
    costs = load_or_measure(engine.target, draft_model, max_width=nodes + 1, context=context_bucket(context),
                            refresh=refresh, progress=progress)
    costs = replace(costs, block=engine.drafter.passes_per_block > 0)
    return TreePolicy(costs, max_gamma=min(MAX_AUTO_GAMMA, engine.max_gamma), branches=TREE_BRANCHES,
                      max_nodes=nodes, learn_costs=_learn_costs(reproducible))
