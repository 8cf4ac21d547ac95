"""One PNG page of a run: loss, reading gap, loss scale, gradient norm, learning rate,
dropped samples.

matplotlib (the ``tools`` extra) is imported only here, with the Agg backend: no display
is needed. :func:`render` returns the Figure (tests read its axes); :func:`save` writes it.
Each panel is titled (:data:`PANELS`); a panel without data says why, never stays blank.
Skipped steps are scatter markers whose label names their kind and count. The reading gap
(``learning_health.jsonl``) is drawn beside the loss: one line per language, in % of its
audio loss, each live verdict's ``since`` step marked.
"""

from __future__ import annotations

import io
import math
import textwrap
from typing import Any

from .._output import write_file
from .reading import DROPPED
from .verdict import LEARNING_DEFAULTS, Facts, Finding, headline

READING = "Reading gap per language"
PANELS = ("Loss", READING, "Loss scale", "Gradient norm", "Learning rate",
          "Dropped samples by reason")
STEP_PANELS = ("Loss", READING, "Loss scale", "Gradient norm", "Learning rate")
NOT_CHECKED = "learning not checked (no reading gap measured)"
# Marker style per kind of skipped step, and the label prefix tests and readers find.
SKIP_STYLE = {
    "nonfinite_loss": ("x", "tab:red", "skipped: non-finite loss"),
    "nonfinite_grad": ("X", "tab:red", "skipped: non-finite gradient"),
    "loss_spike": ("D", "tab:purple", "skipped: loss spike"),
    "overflow": ("v", "tab:orange", "skipped: fp16 overflow"),
}
MICRO_STYLE = ("o", "tab:gray", "non-finite micro-batch left out")
LOSS_LABELS = {"loss": "total loss", "loss_mel_ce": "mel (audio-token) loss",
               "loss_text_ce": "text loss"}


def _pyplot() -> Any:
    try:
        import matplotlib  # lazy: matplotlib is optional (the tools extra) and heavy
    except ImportError as exc:
        raise ImportError("the report's plot needs matplotlib: pip install "
                          "'training-patches[tools]' (or pip install matplotlib)") from exc
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # lazy: matplotlib is optional and heavy

    return plt


def _empty(ax: Any, why: str) -> None:
    ax.text(0.5, 0.5, textwrap.fill(why, 48), ha="center", va="center", fontsize=9,
            color="0.35", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _mark_skips(ax: Any, f: Facts) -> None:
    """One scatter per kind of skipped step, at the step, near the top of the panel."""
    top = ax.get_xaxis_transform()  # x in steps, y in panel height
    kinds: dict[str, list[int]] = {}
    for skip in f.skips:
        kinds.setdefault(skip.kind, []).append(skip.step)
    for kind, steps in kinds.items():
        marker, color, label = SKIP_STYLE.get(kind, ("x", "tab:red", f"skipped: {kind}"))
        ax.scatter(steps, [0.95] * len(steps), marker=marker, color=color, s=60, zorder=5,
                   transform=top, label=f"{label} ({len(steps)})", clip_on=False)
        for step in steps:
            ax.axvline(step, color=color, alpha=0.25, lw=1)
    if f.micro_batches:
        marker, color, label = MICRO_STYLE
        ax.scatter(f.micro_batches, [0.88] * len(f.micro_batches), marker=marker,
                   color=color, s=30, zorder=5, transform=top,
                   label=f"{label} ({len(f.micro_batches)})")


def _loss(ax: Any, f: Facts) -> None:
    ax.set_title("Loss")
    if not f.losses:
        _empty(ax, "no loss values recorded: no training losses in the run folder's "
                   "TensorBoard files, trainer_state.json or metrics.csv"
                   + (f" ({len(f.skips)} skipped steps recorded)" if f.skips else ""))
        if not f.skips:
            return
        ax.set_xlim(-1, max(f.steps, 1))
    handles = []
    for name in ("loss", "loss_mel_ce"):
        series = f.losses.get(name)
        if series:
            handles += ax.plot([s for s, _ in series], [v for _, v in series], lw=1.2,
                               marker="." if len(series) < 60 else None,
                               label=LOSS_LABELS[name])
    text = f.losses.get("loss_text_ce")
    if text:  # weighted 0.01 by default: on its own axis, or it lies flat at the bottom
        right = ax.twinx()
        handles += right.plot([s for s, _ in text], [v for _, v in text], lw=1.0, ls="--",
                              color="tab:green", marker="." if len(text) < 60 else None,
                              label=LOSS_LABELS["loss_text_ce"] + " (right axis)")
        right.tick_params(axis="y", labelsize=8, colors="tab:green")
    _mark_skips(ax, f)
    ax.set_xlabel("step")
    ax.set_xlim(-0.5, max(f.steps, 1) - 0.5)
    ax.legend(handles=handles + [c for c in ax.collections], fontsize=8, loc="upper right",
              bbox_to_anchor=(1.0, 0.9))


def _line(ax: Any, title: str, series: list[tuple[int, float]], why: str,
          log: bool = False) -> None:
    ax.set_title(title)
    if not series:
        _empty(ax, why)
        return
    ax.plot([s for s, _ in series], [v for _, v in series], lw=1.2,
            marker="." if len(series) < 60 else None)
    if log and all(v > 0 for _, v in series):
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_xlim(-0.5, max(series[-1][0] + 0.5, 0.5))


def _reading(ax: Any, f: Facts) -> None:
    """The relative reading gap of each language over the steps, the floor under which a
    language is not read (``reading_min_gap``), and each live verdict's ``since`` step."""
    ax.set_title(READING)
    if not f.learning_checked:
        _empty(ax, NOT_CHECKED + (": " + "; ".join(f.not_measured) if f.not_measured else ""))
        return
    colors = {}
    for language, points in f.readings.items():
        known = [p for p in points if p.step is not None]
        values = [100 * p.relative if p.relative is not None else math.nan for p in known]
        (line,) = ax.plot([p.step for p in known], values, lw=1.2, label=language,
                          marker="." if len(known) < 60 else None)
        colors[language] = line.get_color()
    thresholds = (f.probe or {}).get("thresholds")
    floor = (thresholds if isinstance(thresholds, dict) else {}).get(
        "reading_min_gap", LEARNING_DEFAULTS["reading_min_gap"])
    if isinstance(floor, (int, float)):
        ax.axhline(100 * floor, color="0.5", ls=":", lw=1,
                   label=f"not read below ({100 * floor:g}%)")
    for verdict in f.live_verdicts:
        if verdict.since is None:
            continue
        span = (f"since {verdict.since}" if verdict.holds
                else f"{verdict.since}-{verdict.ended_at if verdict.ended_at is not None else '?'}")
        ax.axvline(verdict.since, color=colors.get(verdict.language or "", "tab:red"),
                   ls="--", lw=1.2, alpha=0.9 if verdict.holds else 0.35,
                   label=f"{verdict.what}: {span}")
    ax.set_xlabel("step")
    ax.set_ylabel("% of the audio loss")
    ax.legend(fontsize=7, loc="best")


def _scale(ax: Any, f: Facts) -> None:
    ax.set_title("Loss scale")
    if not f.scale:
        _empty(ax, "no loss scale recorded: the run used no GradScaler (fp32 or bf16), or "
                   "a scaler other than SafeGradScaler without TensorBoard logging")
        return
    steps = [s for s, _ in f.scale] + [max(f.steps - 1, f.scale[-1][0])]
    values = [v for _, v in f.scale] + [f.scale[-1][1]]
    ax.step(steps, values, where="post", lw=1.2, label=f"from {f.scale_source}")
    if f.overflows:
        at = {s: v for s, v in f.scale}
        ax.scatter(f.overflows, [at.get(s, values[-1]) for s in f.overflows], marker="v",
                   color="tab:orange", zorder=5,
                   label=f"overflow, step skipped ({len(f.overflows)})")
    if all(v > 0 for v in values):
        ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.legend(fontsize=8)


def _grad_norm(ax: Any, f: Facts) -> None:
    if f.grad_norm and not any(v for _, v in f.grad_norm):
        ax.set_title("Gradient norm")
        _empty(ax, "gradient norm not measured: the coqui Trainer logs 0 when grad_clip is 0 "
                   "and no GradScaler is used")
        return
    _line(ax, "Gradient norm", f.grad_norm,
          "no gradient norm recorded (no TensorBoard grad_norm)")
    if f.grad_norm:
        for skip in f.skips:  # a skipped step has no norm: shown where it would be
            ax.axvline(skip.step, color=SKIP_STYLE.get(skip.kind, SKIP_STYLE["overflow"])[1],
                       alpha=0.3, lw=1)


def _dropped(ax: Any, f: Facts) -> None:
    ax.set_title("Dropped samples by reason")
    if not f.dropped:
        _empty(ax, "no sample dropped" if f.run.files.get(DROPPED) is not None
               or f.patch_stats else "no dropped_samples.jsonl: no sample dropped, or the "
                                     "dataset guard was off")
        return
    reasons = [r for r, _ in f.dropped.most_common()]
    counts = [f.dropped[r] for r in reasons]
    bars = ax.barh(reasons, counts, color="tab:brown", height=0.5)
    ax.bar_label(bars, fontsize=8)
    ax.set_ylim(len(reasons) - 0.5 + max(0, 3 - len(reasons)) / 2, -0.5 - max(0, 3 - len(reasons)) / 2)
    from matplotlib.ticker import MaxNLocator  # lazy: matplotlib is optional and heavy

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, max(counts) * 1.15)
    ax.set_xlabel("samples")
    ax.tick_params(axis="y", labelsize=8)


def render(f: Facts, findings: list[Finding]) -> Any:
    """The report page as a matplotlib Figure (not saved)."""
    plt = _pyplot()
    fig = plt.figure(figsize=(12, 9.5), dpi=80, layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=[1.3, 1, 1])
    top = grid[0, :].subgridspec(1, 2, width_ratios=[3, 2])
    axes = {name: fig.add_subplot(spec) for name, spec in zip(
        PANELS, (top[0, 0], top[0, 1], grid[1, 0], grid[1, 1], grid[2, 0], grid[2, 1]))}
    _loss(axes["Loss"], f)
    _reading(axes[READING], f)
    if f.losses and f.learning_checked:  # on the loss's steps, so the two read side by side
        (low, high), (r_low, r_high) = axes["Loss"].get_xlim(), axes[READING].get_xlim()
        axes[READING].set_xlim(min(low, r_low), max(high, r_high))
    _scale(axes["Loss scale"], f)
    _grad_norm(axes["Gradient norm"], f)
    _line(axes["Learning rate"], "Learning rate", f.lr,
          "no learning rate recorded (no TensorBoard current_lr)")
    _dropped(axes["Dropped samples by reason"], f)
    from matplotlib.ticker import MaxNLocator  # lazy: matplotlib is optional and heavy

    for name in STEP_PANELS:
        if axes[name].lines or axes[name].collections:  # empty panels keep no ticks
            axes[name].xaxis.set_major_locator(MaxNLocator(integer=True))
    lines = [f"{f.run.folder}", f"verdict: {headline(findings)}"]
    lines += [f"- {x.name}: {x.detail}"[:160] for x in findings[:4]]
    fig.suptitle("\n".join(lines), fontsize=9, x=0.01, ha="left")
    return fig


# The PNG's tEXt "Software" entry: how ``report`` knows a picture it may replace.
SOFTWARE = "training-patches report"


def png_bytes(fig: Any) -> bytes:
    """``fig`` as PNG bytes, marked as a report's picture (:data:`SOFTWARE`); closes it."""
    plt = _pyplot()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": SOFTWARE})
    plt.close(fig)
    return buffer.getvalue()


def save(fig: Any, path: str, *, replace: bool = True) -> str:
    """Write ``fig`` as a PNG to ``path`` (complete or absent) and close it; returns the
    path. ``replace=False``: only if nothing is there (else :class:`OutputExists`)."""
    write_file(path, png_bytes(fig), replace=replace)
    return path
