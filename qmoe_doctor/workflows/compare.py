"""`qmoe-doctor run --compare REFERENCE -- COMMAND`: the command (the *subject*, the run pass)
against a reference, launch by launch, from the tensors' fingerprints (docs/run.md, "Compare").

::

    REFERENCE --reference_plan--> (kind, argv, env)     checked before anything runs
      blocking          the command with CUDA_LAUNCH_BLOCKING=1
      repeat            the command again
      "python x.py .."  another command (shlex), its program found on PATH
    run pass (prints on) ... the reference passes, --repeat N times (prints on)
    each pass's folder --read_pass_prints--> PassPrints (prints-<pid>-<token>.jsonl beside each record)
    --diagnose.compare.compare_prints--> RunCompare

Never imports torch: the fingerprints are taken in the command's processes by the monitor.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from qmoe_doctor.core import knobs
from qmoe_doctor.core.compare import CompareKind, RunCompare
from qmoe_doctor.core.fingerprints import read_prints
from qmoe_doctor.core.inputs import InputError, read_text
from qmoe_doctor.core.launches import ProcessRecord
from qmoe_doctor.core.records import from_json
from qmoe_doctor.core.reports import RunPass
from qmoe_doctor.diagnose.compare import PassPrints, ProcessRun, compare_prints

#: A prints file larger than this is not read (the monitor stops writing one at 64 MiB).
MAX_PRINTS_READ = 80 * 2**20
#: A source file read for the scan suggestion is at most this large.
MAX_SOURCE_BYTES = 4 * 2**20


class CompareInputError(ValueError):
    """A reference that cannot be run or compared (exit 2)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferencePlan:
    kind: CompareKind
    argv: tuple[str, ...]
    env: dict[str, str]
    repeat: int

    @property
    def name(self) -> str:
        if self.kind is CompareKind.BLOCKING:
            return "blocking (the command with CUDA_LAUNCH_BLOCKING=1)"
        if self.kind is CompareKind.REPEAT:
            return "repeat (the command again)"
        return shlex.join(self.argv)


def reference_plan(
    text: str,
    command: Sequence[str],
    repeat: int,
    resolve: Callable[[Sequence[str], Mapping[str, str]], list[str]],
    environ: Mapping[str, str],
) -> ReferencePlan:
    """What ``--compare TEXT`` runs, checked before anything runs (``resolve``: the run's own
    check that a command's program exists). Raises CompareInputError."""
    if repeat < 1:
        raise CompareInputError(f"--repeat {repeat}: the reference runs at least once (the default is 2)")
    word = text.strip()
    if word == "blocking":
        return ReferencePlan(
            kind=CompareKind.BLOCKING,
            argv=tuple(command),
            env={knobs.CUDA_LAUNCH_BLOCKING: "1"},
            repeat=repeat,
        )
    if word == "repeat":
        return ReferencePlan(kind=CompareKind.REPEAT, argv=tuple(command), env={}, repeat=repeat)
    try:
        argv = shlex.split(word)
    except ValueError as exc:
        raise CompareInputError(f"--compare {text!r}: {exc}") from None
    if not argv:
        raise CompareInputError("--compare needs a reference: blocking, repeat, or a command in quotes")
    try:
        resolved = resolve(argv, environ)
    except ValueError as exc:
        raise CompareInputError(f"--compare {text!r}: {exc}") from None
    return ReferencePlan(kind=CompareKind.COMMAND, argv=tuple(resolved), env={}, repeat=repeat)


def _label(record: ProcessRecord | None, pid: int) -> tuple[str, int | None, float]:
    if record is None:
        return f"pid {pid}", None, 0.0
    return record.label, record.rank, record.started


def read_pass_prints(folder: Path) -> tuple[PassPrints, list[str]]:
    """Every process's prints in a pass's folder (by rank, then start), and notes on files that
    could not be read or processes whose prints stopped early."""
    runs: list[tuple[tuple[bool, int, float, int], ProcessRun]] = []
    notes: list[str] = []
    for path in sorted(folder.glob("prints-*.jsonl")):
        suffix = path.name.removeprefix("prints-").removesuffix(".jsonl")
        pid_text = suffix.split("-", 1)[0]
        pid = int(pid_text) if pid_text.isdigit() else 0
        record: ProcessRecord | None = None
        record_path = folder / f"process-{suffix}.json"
        try:
            record = from_json(ProcessRecord, read_text(record_path, limit=32 * 2**20, gunzip=False))
        except (InputError, ValueError, TypeError, KeyError):
            record = None
        label, rank, started = _label(record, pid)
        try:
            prints = read_prints(read_text(path, limit=MAX_PRINTS_READ, gunzip=False))
        except InputError as exc:
            notes.append(f"{path.name}: could not be read ({exc})")
            continue
        state = prints.state
        if prints.unreadable:
            notes.append(f"{label}: {prints.unreadable} line(s) of its prints could not be read")
        if state is None or not state.final:
            notes.append(
                f"{label}: its prints were not written at its end (killed or crashed): the launches after its last flush are missing"
            )
        if state is not None:
            if state.stopped:
                notes.append(f"{label}: {state.stopped}")
            if state.lost:
                notes.append(
                    f"{label}: {state.lost} printed launch(es) lost ({'; '.join(state.problems[:1]) or 'the process ended first'})"
                )
            if state.kernels_at_limit:
                notes.append(
                    f"{label}: {', '.join(state.kernels_at_limit)} launched more than {state.limit} times: "
                    f"launches past the first {state.limit} of each are not compared ({state.past_limit:,} of them)"
                )
            for problem in state.problems:
                notes.append(f"{label}: {problem}")
        if not prints.launches:
            continue
        runs.append(
            ((rank is None, rank or 0, started, pid), ProcessRun(label=label, rank=rank, prints=prints))
        )
    runs.sort(key=lambda r: r[0])
    return PassPrints(processes=tuple(run for _, run in runs)), notes


def _source_reader(path: str) -> str | None:
    try:
        return read_text(path, limit=MAX_SOURCE_BYTES)
    except InputError:
        return None


def compare_passes(
    plan: ReferencePlan,
    subject: RunPass,
    subject_folder: Path,
    references: Sequence[tuple[RunPass, Path]],
    *,
    limit: int,
) -> RunCompare:
    """The compare section from the passes' folders. Raises CompareInputError when a reference
    run printed no launch while the subject did (nothing to compare with)."""
    prints, notes = read_pass_prints(subject_folder)
    ref_prints: list[PassPrints] = []
    for k, (done, folder) in enumerate(references, 1):
        got, more = read_pass_prints(folder)
        notes += [f"reference run {k}: {note}" for note in more]
        if not got.processes:
            ended = f" ({done.end})" if done.exit_code else ""
            raise CompareInputError(
                f"the reference {plan.name} launched no Triton kernel in run {k}{ended}: nothing to compare with"
            )
        if done.exit_code != subject.exit_code:
            notes.append(
                f"reference run {k} ended otherwise than the subject: {done.end} (the subject: {subject.end})"
            )
        ref_prints.append(got)
    result = compare_prints(
        plan.kind,
        prints,
        ref_prints,
        reference=plan.argv,
        reference_env=plan.env,
        limit=limit,
        read_source=_source_reader,
        cwd=os.getcwd(),
    )
    if notes:
        result = replace(result, notes=(*result.notes, *notes))
    return result


def nothing_to_compare(plan: ReferencePlan, limit: int) -> RunCompare:
    """The compare section when the subject printed no launch: no reference was run."""
    return RunCompare(
        kind=plan.kind,
        reference=plan.argv,
        reference_env=plan.env,
        repeat=0,
        limit=limit,
        verdict="nothing compared: the command made no Triton launch that could be printed, so no reference was run",
    )


__all__ = [
    "CompareInputError",
    "ReferencePlan",
    "compare_passes",
    "nothing_to_compare",
    "read_pass_prints",
    "reference_plan",
]
