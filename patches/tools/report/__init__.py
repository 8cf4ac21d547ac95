"""``training-patches report RUN_DIR [--out report.png]``: a run's health at a glance.

Finds the runs under RUN_DIR (:mod:`.reading`), reads the patches' JSON-lines records and
the coqui Trainer's TensorBoard files, prints the figures and a verdict (:mod:`.verdict`)
and draws one PNG page (:mod:`.plotting`, matplotlib imported only then). The command puts
the page in the current folder (``training_report_<RUN_DIR's name>.png``) unless ``--out``
says where; it writes only a new ``.png`` or a picture it drew before, never one of the
run's records. ``--json FILE`` writes the same findings as one JSON object
(:func:`report_json`; ``-``: on stdout, instead of the text). Exit code 0: healthy; 1:
something needs a look; 2: no run found, RUN_DIR is not a folder, or ``--out``/``--json``
was refused (nothing written).
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from dataclasses import dataclass
from typing import Any

from ..._log import logger
from .._output import STDOUT, OutputExists, WriteFailed, check_output, tool_json, write_json
from .freeze_check import check_frozen_rows, new_rows_of
from .plotting import render, save
from .reading import Run, find_runs, read_jsonl
from .verdict import HEALTHY, Facts, Finding, describe, facts, headline, verdict

REPORT_NAME = "training_report.png"

__all__ = ["REPORT_NAME", "Report", "ReportOutputError", "build", "write_report", "check_out",
           "report_json", "JSON_FORMAT",
           "default_out", "is_report_picture", "find_runs", "read_jsonl", "facts", "verdict",
           "headline", "register"]


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
        return render(self.facts, self.findings)


def build(run: Run) -> Report:
    """The report of one run found by :func:`find_runs`."""
    figures = facts(run)
    figures.freeze = check_frozen_rows(run)
    figures.new_rows = new_rows_of(run)
    findings = verdict(figures)
    return Report(run, figures, findings, describe(figures, findings))


class NoRunFound(FileNotFoundError):
    """A folder holds none of the files a training run writes."""


def no_run_message(folder: str) -> str:
    return (f"training-patches report: no run found in {folder}: it holds none of the files a "
            f"run writes (nonfinite_events.jsonl, dropped_samples.jsonl, loss_scale.jsonl, "
            f"learning_health.jsonl, headless_runs.jsonl, trainer_runs.jsonl, TensorBoard "
            f"events.out.tfevents.*, trainer_0_log.txt, the Hugging Face Trainer's "
            f"trainer_state.json, Lightning's metrics.csv), "
            f"nor does any folder below it (3 levels searched). Give the output folder of the "
            f"run (headlessXttsTrain.py --output-dir, the coqui Trainer's output_path, the "
            f"Hugging Face Trainer's output_dir, Lightning's log_dir, or where a plain loop "
            f"saves its checkpoints).")


class ReportOutputError(ValueError):
    """``--out`` names a file the report must not write (one paragraph for the user)."""


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_software(path: str) -> str | None:
    """The tEXt "Software" entry of a PNG file, "" when it has none, None if not a PNG."""
    try:
        with open(path, "rb") as handle:
            if handle.read(8) != PNG_SIGNATURE:
                return None
            while True:
                head = handle.read(8)
                if len(head) < 8:
                    return ""
                length, kind = struct.unpack(">I4s", head)
                if kind == b"IDAT" or kind == b"IEND":
                    return ""  # matplotlib writes its text chunks before the image data
                data = handle.read(length)
                handle.seek(4, os.SEEK_CUR)  # CRC
                if kind == b"tEXt" and data.startswith(b"Software\x00"):
                    return data[9:].decode("latin-1")
    except OSError:
        return None


def is_report_picture(path: str | os.PathLike[str]) -> bool:
    """A PNG this command drew: marked with :data:`plotting.SOFTWARE`, or (drawn before the
    mark existed) a matplotlib PNG named ``training_report*.png``."""
    software = _png_software(os.fspath(path))
    if software is None:
        return False
    return software.startswith("training-patches") or (
        software.startswith("Matplotlib") and os.path.basename(path).startswith("training_report"))


def check_out(path: str | os.PathLike[str]) -> bool:
    """Raise :class:`ReportOutputError` unless ``path`` may take the report's PNG: a new
    ``.png`` file, or a picture the report drew before. Returns whether it exists (and is
    then replaced). A run's own records (``nonfinite_events.jsonl``, a checkpoint, the
    TensorBoard files) are never such a file."""
    path = os.fspath(path)
    todo = ("The report only writes a new .png file or replaces a picture it drew itself, so "
            "nothing was written and the file is untouched. Give a new file name ending in "
            ".png (e.g. --out training_report.png), or a folder to put training_report.png in.")
    if os.path.splitext(path)[1].lower() != ".png":
        raise ReportOutputError(
            f"training-patches report: --out {path} does not end in .png, and the report is a "
            f"PNG picture" + (" (a file of that name exists: it may be one of the run's "
                              "records)" if os.path.lexists(path) else "") + f". {todo}")
    if not os.path.lexists(path):
        return False
    if not os.path.isfile(path):
        raise ReportOutputError(f"training-patches report: --out {path} exists and is not a "
                                f"regular file. {todo}")
    if not is_report_picture(path):
        raise ReportOutputError(
            f"training-patches report: --out {path} exists and is not a picture drawn by "
            f"training-patches report (it may be one of the run's files, or someone else's "
            f"picture). {todo}")
    return True


def default_out(run_dir: str | os.PathLike[str]) -> str:
    """Where the command puts the PNG without ``--out``: the current folder, named after the
    run folder (``training_report_<name>.png``), so the run's folder holds only what the
    run wrote."""
    name = os.path.basename(os.path.abspath(os.fspath(run_dir))) or "run"
    return f"training_report_{name}.png"


JSON_TOOL = "training-patches report"
JSON_FORMAT = 1  # raised when a key changes meaning or goes away (new keys may be added)


def _run_json(report: Report) -> dict[str, Any]:
    f, run = report.facts, report.run
    loss = f.losses.get("loss", [])
    return {
        "folder": run.folder, "shared_folders": run.shared_folders, "run_ids": run.run_ids,
        "verdict": report.headline, "healthy": report.healthy,
        "findings": [{"name": x.name, "detail": x.detail} for x in report.findings],
        "steps": f.steps, "steps_known": f.steps_known,
        "skipped_steps": [{"step": s.step, "kind": s.kind, "loss": s.loss,
                           "seen_on_ranks": s.seen_on, "followed_on_ranks": s.followed_on}
                          for s in f.skips],
        "longest_skip_streak": f.longest_streak,
        "micro_batches_left_out": len(f.micro_batches),
        "loss": {"first": list(loss[0]), "last": list(loss[-1]), "logged": len(loss),
                 "source": f.loss_source} if loss else None,
        "loss_scale": {"first": f.scale[0][1], "last": f.scale[-1][1],
                       "backoffs": f.backoffs, "source": f.scale_source} if f.scale else None,
        "dropped_samples": dict(f.dropped), "oom_batches": f.ooms,
        "frozen_rows": f.freeze,
        "new_rows": f.new_rows,
        "ranks": {str(rank): vars(figures) for rank, figures in f.ranks.items()},
        "records": run.files, "unreadable_lines": run.broken_lines,
        "impossible_records": dict(f.impossible), "not_checked": f.not_checked,
        "tensorboard": {"files": run.tb_files, "problem": run.tb_problem,
                        "incomplete": run.tb_incomplete},
        "learning": {
            "checked": f.learning_checked, "probe": f.probe, "not_measured": f.not_measured,
            "readings": {lang: [vars(p) for p in points] for lang, points in f.readings.items()},
            "verdicts": [{"name": v.name, "holds": v.holds, **vars(v)}
                         for v in f.live_verdicts]},
        "resume_checks": [{"at": c.at, **vars(c)} for c in f.resumes],
    }


def report_json(folder: str | os.PathLike[str], reports: list[Report], png: str | None
                ) -> dict[str, Any]:
    """The ``--json`` object: ``tool``, ``format`` (:data:`JSON_FORMAT`), ``run_dir``,
    ``healthy`` and ``exit_code`` (as the command's), ``picture`` (the PNG's path or null)
    and ``runs``: one object per run, oldest first (the newest is the one drawn), with its
    ``verdict``, ``findings`` ([{name, detail}]) and figures (see the user guide)."""
    healthy = all(r.healthy for r in reports)
    return {"tool": JSON_TOOL, "format": JSON_FORMAT,
            "run_dir": os.path.abspath(os.fspath(folder)), "healthy": healthy,
            "exit_code": 0 if healthy else 1, "picture": png,
            "runs": [_run_json(r) for r in reports]}


def check_json_out(path: str, folder: str, png: str | None, force: bool) -> bool:
    """The shared output rule (:func:`patches.tools._output.check_output`) for ``--json``:
    never the picture, never a file of a run under ``folder`` (its records, TensorBoard
    files, checkpoints) and, with --force or without, no file but a report JSON written
    before. Returns whether a file is there."""
    if path == STDOUT:
        return False
    inputs: list[tuple[str, str | None]] = []
    target = os.path.dirname(os.path.abspath(path))
    own = tool_json(JSON_TOOL)  # what --force may replace: a report JSON, nothing else
    if os.path.lexists(path) and not own.test(path):
        for run in find_runs(folder, scalars=False):
            if target in (run.folder, *run.shared_folders):
                inputs.append((f"record of the run in {target}", path))
    try:
        return check_output(path, prog=JSON_TOOL, what="--json", force=force, inputs=inputs,
                            others=[("--out", png)], example="report.json", own=own)
    except ValueError as exc:
        raise ReportOutputError(str(exc)) from None


def write_report(folder: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                 *, replace: bool = True) -> tuple[list[Report], str | None]:
    """Reports of every run under ``folder`` (newest last) and the PNG of the newest.

    The PNG goes to ``out`` (default ``<folder>/training_report.png``: the trainer's own
    report, :func:`log_report`); None when matplotlib is missing. ``out`` must be a new
    ``.png`` file or, with ``replace``, a picture drawn before (:func:`check_out`, checked
    before anything is read; the command passes ``replace`` only with ``--force``). Raises
    :class:`NoRunFound` when there is no run, :class:`ReportOutputError` for a refused
    ``out``.
    """
    folder = os.fspath(folder)
    path = os.fspath(out) if out is not None else os.path.join(folder, REPORT_NAME)
    exists = check_out(path)
    if exists and not replace:
        raise ReportOutputError(
            f"training-patches report: the picture {path} already exists (the report drew it "
            f"before); nothing was written and it is untouched. Pass --force to draw it again, "
            f"or give --out a new file name ending in .png.")
    runs = find_runs(folder)
    if not runs:
        raise NoRunFound(no_run_message(folder))
    reports = [build(run) for run in runs]
    try:
        fig = reports[-1].figure()
    except ImportError:  # no matplotlib
        return reports, None
    try:
        return reports, save(fig, path, replace=exists)
    except OutputExists:
        raise ReportOutputError(
            f"training-patches report: --out {path} was created by another program while "
            f"the report was drawn; it was left as it is. Run the report again, or give "
            f"another file name.") from None


def _report(args: argparse.Namespace) -> int:
    folder = args.run_dir
    if not os.path.isdir(folder):
        print(f"training-patches report: {folder} is not a folder. Give the run's output "
              f"folder (the one holding headless_runs.jsonl, the coqui run folder, or the "
              f"checkpoints of a plain loop).", file=sys.stderr)
        return 2
    out = None
    in_run = False
    if not args.no_picture:
        out = args.out if args.out is not None else default_out(folder)
        if args.out is None:  # the default never lands in a run's own folder
            here = os.path.abspath(".")
            in_run = any(here in (run.folder, *run.shared_folders)
                         for run in find_runs(folder, scalars=False))
            out = None if in_run else out
        elif os.path.isdir(out):
            out = os.path.join(out, REPORT_NAME)
    kept = None  # a picture the report drew before, left as it is (no --force)
    try:
        if args.json is not None:
            check_json_out(args.json, folder, out, args.force)
        if out is not None and check_out(out) and not args.force:
            kept, out = out, None  # the text verdict still comes: a re-check is routine
        if out is None:
            runs = find_runs(folder)
            if not runs:
                raise NoRunFound(no_run_message(folder))
            reports, png = [build(run) for run in runs], None
        else:
            reports, png = write_report(folder, out, replace=args.force)
        if args.json is not None:
            write_json(args.json, report_json(folder, reports, png), replace=args.force,
                       prog=JSON_TOOL)
    except (NoRunFound, ReportOutputError, ValueError) as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except WriteFailed as exc:  # the system refused the write: not a usage error
        print(f"training-patches report: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"training-patches report: could not write {exc.filename or out} "
              f"({exc.strerror or exc}); choose another place with --out or --json.",
              file=sys.stderr)
        return 2
    healthy = all(r.healthy for r in reports)
    if args.json == STDOUT:  # the JSON object is the whole of stdout
        return 0 if healthy else 1
    newest = reports[-1]
    print("\n".join(newest.lines))
    others = reports[:-1]
    if others:
        print(f"{len(others)} other run(s) under {folder} (pass the folder to see one):")
        for other in others:
            print(f"  {other.run.folder}: {other.headline}")
    if args.no_picture:
        print("picture: not drawn (--no-picture)")
    elif kept is not None:
        print(f"picture: not drawn: {kept} exists (the report drew it before; it is left as "
              f"it is: --force draws it again, --out another name)")
    elif in_run:
        print("picture: not drawn: the current folder is the run's own folder, which the "
              "report writes into only when asked (--out FILE.png)")
    else:
        print(f"picture: {png}" if png else "picture: not drawn (matplotlib is missing: pip "
              "install 'training-patches[tools]')")
    if args.json is not None:
        print(f"json: {args.json}")
    print("health: OK" if healthy else "health: needs a look (see the verdict above)")
    return 0 if healthy else 1


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``report`` to the ``training-patches`` command."""
    rep = sub.add_parser(
        "report", help="a run's health: figures, a verdict and a PNG page of plots",
        description="Find the runs under RUN_DIR, print their figures and a verdict (healthy, "
                    "unstable scale, stalled loss, repeated skips, frozen rows moved, ...) and "
                    "draw the newest as one PNG page (in the current folder unless --out "
                    "says where). Exit 0: healthy; 1: needs a look; 2: no run found or "
                    "--out refused.")
    rep.add_argument("run_dir", help="a run's output folder (or the folder above its runs)")
    rep.add_argument("--out", default=None,
                     help="where the PNG goes: a new .png file, a picture the report drew "
                          "before (replaced with --force), or a folder "
                          "(FOLDER/training_report.png). "
                          "Default: training_report_<RUN_DIR's name>.png in the current "
                          "folder; never one of the run's own files")
    rep.add_argument("--no-picture", action="store_true",
                     help="draw no PNG (the text, and --json, only)")
    rep.add_argument("--json", metavar="FILE", default=None,
                     help="also write the findings as one strict JSON object (NaN/Infinity "
                          "as strings); - puts it on stdout instead of the text. Never one "
                          "of the run's files; an existing FILE only with --force")
    rep.add_argument("--force", action="store_true",
                     help="replace an existing --json FILE (a report JSON) or a picture the "
                          "report drew before")
    rep.set_defaults(handler=_report)




def log_report(folder: str | os.PathLike[str]) -> str | None:
    """Write ``<folder>/training_report.png`` at the end of a run and log its verdict.

    For trainers (headlessXttsTrain.py calls it last): a report that cannot be made is
    a WARNING, never an error of the finished run. Returns the PNG's path, or None.
    """
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
