"""Rendering decode statistics: pure functions of a snapshot, so the live panel, the final
panel, the piped summary and the chat footer all show the same numbers.

`live_view(stats, engine, policy)` takes the snapshot; `render_stats(view)` turns it into a
Rich table; `summary_line(view)` into one plain line (no control codes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from rich import box
from rich.table import Table
from rich.text import Text

from mlx_spec.core.cost_model import weight_bandwidth, weight_bytes
from mlx_spec.core.policy import AutoGamma
from mlx_spec.core.stats import Stats

if TYPE_CHECKING:
    from mlx_spec.apps.runner import Gamma

BAR_WIDTH = 20
_EIGHTHS = " ▏▎▍▌▋▊▉█"


@dataclass
class View:
    """A snapshot of everything the display shows."""

    stats: Stats
    drafter: str  # "model", "ngram", "none"
    gamma_mode: Gamma  # as set: a whole number, "auto" or "tree"
    gamma_now: int  # the last round's γ
    bandwidth: float  # achieved weight bandwidth, bytes/s
    predicted_speedup: Optional[float] = None  # AutoGamma's expectation at its current γ
    measured_speedup: Optional[float] = None  # decode tok/s over the cost curve's plain rate,
    # only once something was drafted (without drafting it would be timing noise)
    plain_tps: Optional[float] = None  # 1 / plain round time, learned in this run where it could be
    plain_measured: bool = False  # plain_tps from this run's plain rounds (not the calibration)
    interrupted: bool = False  # the user stopped the run (Ctrl-C)

    def as_dict(self) -> dict:
        """Derived metrics for --json (the counters are in stats.as_dict())."""
        return {
            "gamma_now": self.gamma_now,
            "weight_bandwidth_bytes_per_s": self.bandwidth,
            "predicted_speedup": self.predicted_speedup,
            "measured_speedup": self.measured_speedup,
            "plain_tps_estimate": self.plain_tps,
            "plain_tps_measured": self.plain_measured,
            "prefill_share": _prefill_share(self.stats),
            "interrupted": self.interrupted,
        }


class ViewMaker:
    """Builds `View`s for one engine and γ policy; weight sizes are computed once."""

    def __init__(self, engine, policy, gamma_mode: Gamma):
        self.engine = engine
        self.policy = policy
        self.gamma_mode = gamma_mode
        self.drafter = engine.drafter.name if engine.drafter is not None else "none"
        draft_model = None if engine.drafter is None else engine.drafter.model
        self.target_bytes = weight_bytes(engine.target)
        self.draft_bytes = weight_bytes(draft_model) if draft_model is not None else 0

    def __call__(self, stats: Stats, interrupted: bool = False) -> View:
        stats = stats.snapshot()
        view = View(
            stats=stats,
            drafter=self.drafter,
            gamma_mode=self.gamma_mode,
            gamma_now=stats.gamma_last,
            bandwidth=weight_bandwidth(stats, self.target_bytes, self.draft_bytes),
            interrupted=interrupted,
        )
        if isinstance(self.policy, AutoGamma):
            # Plain speed as this run measured it (its plain rounds), else the calibration
            # as corrected by this run's rounds: the machine as it is now, not a stored figure.
            costs = self.policy.costs
            plain = 1.0 / costs.round_time(0)
            view.gamma_now = self.policy.last_choice
            # a tree policy's forecast covers the trees it kept; auto γ's, its current γ
            view.predicted_speedup = getattr(self.policy, "forecast_speedup", None) or \
                self.policy.predicted_speedup(self.policy.last_choice)
            view.plain_tps = plain
            view.plain_measured = 0 in getattr(costs, "learned", {})
            view.measured_speedup = stats.decode_tps / plain if stats.drafted else None
        return view


def _prefill_share(stats: Stats) -> float:
    total = stats.prefill_time + stats.decode_time
    return stats.prefill_time / total if total > 0 else 0.0


def plural(n: int, noun: str) -> str:
    """'1 turn', '2 turns'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def human_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of `width` cells with eighth-cell resolution."""
    eighths = round(max(0.0, min(1.0, fraction)) * width * 8)
    full, part = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[part] if part else "")).ljust(width)


def gamma_text(view: View) -> str:
    if view.gamma_mode.fixed is None:
        return f"{view.gamma_mode} (now {view.gamma_now})"
    return str(view.gamma_mode)


def render_stats(view: View, title: str = "speculative decoding") -> Table:
    """The stats panel: a two-column table (label, value), per-position acceptance as bars."""
    s = view.stats
    if view.interrupted:
        title += " (interrupted)"
    table = Table(box=box.ROUNDED, show_header=False, title=title, title_style="bold",
                  padding=(0, 1), expand=False)
    table.add_column(style="cyan", no_wrap=True, min_width=20)  # labels never squeeze
    table.add_column(overflow="fold")
    table.add_row("decode", f"{s.decode_tps:.1f} tok/s  ({s.generated} tokens in {s.decode_time:.2f} s)")
    who = "target + draft" if view.drafter == "model" else "target"
    table.add_row("prefill", f"{s.prefill_time:.2f} s  ({s.prompt_tokens} prompt tokens, {s.prefill_tokens} "
                             f"forwarded by {who}; {_prefill_share(s):.0%} of time)")
    table.add_row("drafter / γ", f"{view.drafter} / {gamma_text(view)}")
    if s.drafted:
        table.add_row("acceptance α̂", f"{s.acceptance_rate:.3f}  ({s.accepted}/{s.drafted} draft tokens)")
        table.add_row("mean accepted length", f"{s.mean_accepted_length:.2f} tokens/round")
        for i, a in enumerate(s.acceptance_by_position):
            row = Text()
            row.append(bar(a), style="green")
            row.append(f" {a:.2f}  (n={s.drafted_at[i]})")
            table.add_row(f"  position {i + 1}" if not s.tree_rounds else f"  depth {i + 1}", row)
        for k, a in enumerate(s.acceptance_by_rank):  # draft trees: the k-th sibling tried
            row = Text()
            row.append(bar(a), style="green")
            row.append(f" {a:.2f}  (n={s.tried_at_rank[k]})")
            table.add_row(f"  sibling rank {k}", row)
    else:
        table.add_row("acceptance α̂", "— (nothing drafted)")
    if view.measured_speedup is not None:
        table.add_row("speedup", speedup_text(view))
    table.add_row("weight bandwidth", human_rate(view.bandwidth))
    table.add_row("forwards", f"target {s.target_forwards}, draft {s.draft_forwards}")
    table.add_row("peak memory", human_bytes(s.peak_memory))
    return table


def speedup_text(view: View) -> str:
    """Measured speedup and what it is measured against: the plain decoding speed of this
    run's plain rounds, else the cost curve's as this run corrected it (shown only once
    tokens were drafted). "Predicted" is the cost model's speedup for the γ chosen last, not
    for the run so far (which mixes plain rounds and probes), so the two can differ."""
    source = "measured in this run" if view.plain_measured else "from the cost curve"
    return (f"{view.measured_speedup:.2f}× vs plain ≈ {view.plain_tps:.1f} tok/s {source} "
            f"(predicted {view.predicted_speedup:.2f}× now, from the cost curve and this run's acceptance)")


def summary_line(view: View) -> str:
    """One plain line: for stderr when piped, and the chat footer."""
    s = view.stats
    parts = ["interrupted"] if view.interrupted else []
    parts += [f"{s.generated} tok", f"{s.decode_tps:.1f} tok/s", f"prefill {s.prefill_time:.2f} s"]
    parts.append(f"γ {gamma_text(view)}")
    if s.drafted:
        parts.append(f"α̂ {s.acceptance_rate:.2f}")
        parts.append(f"accepted len {s.mean_accepted_length:.2f}")
        parts.append("by position " + " ".join(f"{a:.2f}" for a in s.acceptance_by_position))
        if s.tree_rounds:
            parts.append("by sibling rank " + " ".join(f"{a:.2f}" for a in s.acceptance_by_rank))
    if s.grammar_forced:
        parts.append(f"grammar-forced {s.grammar_forced}")
    if view.measured_speedup is not None:
        parts.append(f"speedup {speedup_text(view)}")
    parts.append(human_rate(view.bandwidth))
    parts.append(f"peak {human_bytes(s.peak_memory)}")
    return " · ".join(parts)
