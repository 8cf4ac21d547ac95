"""``training-patches report RUN_DIR [--out report.png]``: a run's health at a glance.

Finds the runs under RUN_DIR (:mod:`.reading`), reads the patches' JSON-lines records and
the coqui Trainer's TensorBoard files, prints the figures and a verdict (:mod:`.verdict`)
and draws one PNG page (:mod:`.plotting`, matplotlib imported only then). Exit code 0:
healthy; 1: something needs a look; 2: no run found, or RUN_DIR is not a folder.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

from .reading import Run, find_runs, read_jsonl
from .verdict import HEALTHY, Facts, Finding, describe, facts, headline, verdict

REPORT_NAME = "training_report.png"

__all__ = ["REPORT_NAME", "Report", "build", "write_report", "find_runs", "read_jsonl",
           "facts", "verdict", "headline", "register"]


@dataclass
class Report:
    """One run's figures, verdict and text."""

    run: Run
    facts: Facts
    findings: list[Finding]
    lines: list[str]

    @property
    def healthy(self) -> bool:
        return not self.findings

    @property
    def headline(self) -> str:
        return headline(self.findings)

    def figure(self) -> Any:
        """The page as a matplotlib Figure (needs matplotlib)."""
        from .plotting import render

        return render(self.facts, self.findings)


def build(run: Run) -> Report:
    """The report of one run found by :func:`find_runs`."""
    from .freeze_check import check_frozen_rows

    figures = facts(run)
    figures.freeze = check_frozen_rows(run)
    findings = verdict(figures)
    return Report(run, figures, findings, describe(figures, findings))


class NoRunFound(FileNotFoundError):
    """A folder holds none of the files a training run writes."""


def no_run_message(folder: str) -> str:
    return (f"training-patches report: no run found in {folder}: it holds none of the files a "
            f"run writes (nonfinite_events.jsonl, dropped_samples.jsonl, loss_scale.jsonl, "
            f"headless_runs.jsonl, TensorBoard events.out.tfevents.*, trainer_0_log.txt), "
            f"nor does any folder below it (3 levels searched). Give the output folder of the "
            f"run (headlessXttsTrain.py --output-dir, the coqui Trainer's output_path, or "
            f"where a plain loop saves its checkpoints).")


def write_report(folder: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
                 ) -> tuple[list[Report], str | None]:
    """Reports of every run under ``folder`` (newest last) and the PNG of the newest.

    The PNG goes to ``out`` (default ``<folder>/training_report.png``); None when
    matplotlib is missing. Raises :class:`NoRunFound` when there is no run.
    """
    folder = os.fspath(folder)
    runs = find_runs(folder)
    if not runs:
        raise NoRunFound(no_run_message(folder))
    reports = [build(run) for run in runs]
    path = os.fspath(out) if out is not None else os.path.join(folder, REPORT_NAME)
    try:
        from .plotting import save
        fig = reports[-1].figure()
    except ImportError:
        return reports, None
    return reports, save(fig, path)


def _report(args: argparse.Namespace) -> int:
    folder = args.run_dir
    if not os.path.isdir(folder):
        print(f"training-patches report: {folder} is not a folder. Give the run's output "
              f"folder (the one holding headless_runs.jsonl, the coqui run folder, or the "
              f"checkpoints of a plain loop).", file=sys.stderr)
        return 2
    out = args.out
    if out is not None and os.path.isdir(out):
        out = os.path.join(out, REPORT_NAME)
    try:
        reports, png = write_report(folder, out)
    except NoRunFound as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"training-patches report: could not write the picture ({exc}); choose "
              f"another place with --out.", file=sys.stderr)
        return 2
    newest = reports[-1]
    print("\n".join(newest.lines))
    others = reports[:-1]
    if others:
        print(f"{len(others)} other run(s) under {folder} (pass the folder to see one):")
        for other in others:
            print(f"  {other.run.folder}: {other.headline}")
    print(f"picture: {png}" if png else
          "picture: not drawn (matplotlib is missing: pip install 'training-patches[tools]')")
    healthy = all(r.healthy for r in reports)
    print("health: OK" if healthy else "health: needs a look (see the verdict above)")
    return 0 if healthy else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``report`` to the ``training-patches`` command."""
    rep = sub.add_parser(
        "report", help="a run's health: figures, a verdict and a PNG page of plots",
        description="Find the runs under RUN_DIR, print their figures and a verdict (healthy, "
                    "unstable scale, stalled loss, repeated skips, frozen rows moved, ...) and "
                    "draw the newest as one PNG page. Exit 0: healthy; 1: needs a look; "
                    "2: no run found.")
    rep.add_argument("run_dir", help="a run's output folder (or the folder above its runs)")
    rep.add_argument("--out", default=None,
                     help=f"where the PNG goes (default RUN_DIR/{REPORT_NAME})")
    rep.set_defaults(handler=_report)




def log_report(folder: str | os.PathLike[str]) -> str | None:
    """Write ``<folder>/training_report.png`` at the end of a run and log its verdict.

    For trainers (headlessXttsTrain.py calls it last): a report that cannot be made is
    a WARNING, never an error of the finished run. Returns the PNG's path, or None.
    """
    from .._log import logger

    try:
        reports, png = write_report(folder)
    except Exception as exc:  # noqa: BLE001 - the training itself has finished
        logger.warning("training-patches: no run report written for %s (%s: %s)", folder,
                       type(exc).__name__, exc)
        return None
    newest = reports[-1]
    logger.info("training-patches: run report: %s; verdict: %s%s", png or "(no picture: "
                "matplotlib is missing)", newest.headline,
                "".join(f"; {x.name}: {x.detail}" for x in newest.findings))
    return png
