"""`qmoe-doctor run -- COMMAND`: the user's own program, unmodified, watched launch by launch.

::

    COMMAND --isolate.foreground (own terminal, monitor bootstrap on PYTHONPATH)--> processes
      each process that imports Triton --monitor--> ProcessRecord (JSON, in the pass's folder)
    [ProcessRecord] --diagnose.run_findings--> diagnoses, CUDA errors, unflushed processes
    then, when asked and when the first pass gives them something to confirm:
      --blocking  the command again with CUDA_LAUNCH_BLOCKING=1: the launch that raises is the
                  faulting kernel
      --sanitize  the command again under compute-sanitizer memcheck, caching allocator off,
                  restricted to the faulting kernel(s); each invalid address attributed against
                  the recorded tensors of every device (diagnose.attribution); where they agree
                  on one argument and one cause, a diagnosis (run_findings.placed_diagnoses)
    --> RunReport (core.reports)

The command's own output goes to the terminal untouched; its exit status is the run's, unless
``fail_on_finding`` turns a clean exit with a finding into ExitCode.FAULT (README: exit codes).
Never imports torch: the monitor runs in the command's processes, not here.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from qmoe_doctor.core import knobs
from qmoe_doctor.core.compare import RunCompare
from qmoe_doctor.core.error_kind import describe_exit
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.fingerprints import DEFAULT_PRINTED_LAUNCHES
from qmoe_doctor.core.inputs import InputError, read_text
from qmoe_doctor.core.launches import ProcessRecord, SourceLint
from qmoe_doctor.core.records import from_json
from qmoe_doctor.core.reports import (
    AddressNote,
    RunDiagnosis,
    RunPass,
    RunPassLabel,
    RunReport,
    SanitizerRun,
)
from qmoe_doctor.diagnose import run_findings
from qmoe_doctor.diagnose.sanitizer_log import SanitizerReport, parse_sanitizer_log
from qmoe_doctor.isolate.foreground import run_foreground
from qmoe_doctor.isolate.logs import LogDir
from qmoe_doctor.isolate.process import SpawnError
from qmoe_doctor.machine.sanitizer import SanitizerTool, find_compute_sanitizer, sanitizer_command
from qmoe_doctor.workflows import compare as compare_flow

#: A record larger than this is not read (a ring of 256 launches is well under 1 MB).
MAX_RECORD_BYTES = 32 * 2**20
#: compute-sanitizer's log, one per process it watched (%p: the process id).
SANITIZER_LOG = "memcheck-%p.log"


class RunInputError(ValueError):
    """The command cannot be run at all (none given, not found, not executable): exit 2."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    ring: int = knobs.DEFAULT_RUN_RING
    call_sites: int = knobs.DEFAULT_RUN_CALL_SITES
    strict: bool = False  # the monitor raises at the first cross-device launch
    blocking: bool = False  # rerun with CUDA_LAUNCH_BLOCKING=1 after a CUDA error
    sanitize: bool = False  # rerun under compute-sanitizer memcheck
    fail_on_finding: bool = False  # a clean exit with a diagnosis or CUDA error exits 1
    log_dir: Path | None = None  # where the records go (default: a temp folder, kept when needed)
    compare: str | None = None  # --compare REFERENCE: blocking, repeat, or a command (workflows.compare)
    repeat: int = 2  # --repeat N: runs of the reference
    compare_launches: int = DEFAULT_PRINTED_LAUNCHES  # launches of each kernel printed per process


#: Told when a pass starts (label, what runs, why), for the CLI's stderr line.
OnPass = Callable[[RunPassLabel, Sequence[str], str], None]


def bootstrap_dir() -> Path:
    """The folder holding the monitor's ``sitecustomize.py`` (found, not imported: the parent
    never loads the monitor)."""
    spec = importlib.util.find_spec("qmoe_doctor.monitor")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("qmoe_doctor.monitor is not installed beside qmoe_doctor")
    return Path(next(iter(spec.submodule_search_locations))) / "bootstrap"


def package_home() -> Path:
    """The folder that holds the ``qmoe_doctor`` package (for another interpreter to load it)."""
    spec = importlib.util.find_spec("qmoe_doctor")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("qmoe_doctor cannot be found")
    return Path(next(iter(spec.submodule_search_locations))).parent


def resolve_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """The command as given, once its program is known to exist. Raises RunInputError."""
    if not argv:
        raise RunInputError("no command to run: qmoe-doctor run [OPTIONS] -- COMMAND [ARGS...]")
    program = argv[0]
    env = os.environ if environ is None else environ
    if os.sep in program or (os.altsep and os.altsep in program):
        if not Path(program).exists():
            raise RunInputError(f"{program}: no such file")
        if Path(program).is_dir() or not os.access(program, os.X_OK):
            raise RunInputError(f"{program}: is not an executable program")
    elif shutil.which(program, path=env.get("PATH", os.defpath)) is None:
        raise RunInputError(f"{program}: command not found (not on PATH)")
    return list(argv)


def monitor_env(folder: Path, options: RunOptions, environ: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: the user's, with the monitor's bootstrap first on PYTHONPATH
    and its settings."""
    env = dict(environ)
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(bootstrap_dir()) + (os.pathsep + existing if existing else "")
    env[knobs.QMOE_RUN_DIR] = str(folder)
    env[knobs.QMOE_RUN_RING] = str(options.ring)
    env[knobs.QMOE_RUN_CALL_SITES] = str(options.call_sites)
    env[knobs.QMOE_RUN_HOME] = str(package_home())
    if options.strict:
        env[knobs.QMOE_RUN_STRICT] = "1"
    else:
        env.pop(knobs.QMOE_RUN_STRICT, None)
    return env


def read_records(folder: Path) -> tuple[list[ProcessRecord], list[str]]:
    """Every process record in ``folder`` (by rank, then oldest first), and one note per file
    that could not be read."""
    records: list[ProcessRecord] = []
    notes: list[str] = []
    for path in sorted(folder.glob("process-*.json")):
        try:
            records.append(from_json(ProcessRecord, read_text(path, limit=MAX_RECORD_BYTES, gunzip=False)))
        except (InputError, ValueError, TypeError, KeyError) as exc:
            notes.append(f"{path.name}: could not be read ({type(exc).__name__}: {exc})")
    records.sort(key=lambda r: (r.rank is None, r.rank or 0, r.started, r.pid))
    return records, notes


def _exit_code(returncode: int) -> int:
    """The shell's convention: 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _end(returncode: int, forwarded: int | None, killed: bool) -> str:
    text = describe_exit(returncode)
    if forwarded is not None:
        name = signal.Signals(forwarded).name
        text += f" ({name} passed on{', then killed' if killed else ''})"
    return text


def _run_pass(
    label: RunPassLabel,
    argv: Sequence[str],
    *,
    folder: Path,
    options: RunOptions,
    extra_env: Mapping[str, str],
    environ: Mapping[str, str],
    prefix: Sequence[str] = (),
    prints: int = 0,
) -> tuple[RunPass, int | None]:
    """Run the command once; its pass and the signal passed on to it (None: none). ``prints``:
    a compare pass, its launches fingerprinted (that many of each kernel)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = monitor_env(folder, options, environ)
    env.update(extra_env)
    if prints:
        env[knobs.QMOE_RUN_PRINTS] = str(prints)
    else:
        env.pop(knobs.QMOE_RUN_PRINTS, None)
    full = [*prefix, *argv]
    try:
        end = run_foreground(full, env)
    except SpawnError as exc:
        raise RunInputError(str(exc)) from None
    records, notes = read_records(folder)
    blocking = env.get(knobs.CUDA_LAUNCH_BLOCKING, "") not in ("", "0")
    return (
        RunPass(
            label=label,
            argv=tuple(full),
            env=dict(extra_env),
            exit_code=_exit_code(end.returncode),
            end=_end(end.returncode, end.forwarded, end.killed),
            wall_s=round(end.wall_s, 3),
            processes=tuple(records),
            cuda_errors=run_findings.cuda_errors(records, blocking=blocking),
            notes=(*notes, *run_findings.unflushed(records)),
        ),
        end.forwarded,
    )


def _kernel_regex(kernels: Sequence[str]) -> str:
    """compute-sanitizer's ``--kernel-name regex=`` value: the kernels' names, anchored; its
    value is a comma-separated key=value list, so no comma."""
    return "|".join(f"^{re.escape(k)}$" for k in kernels).replace(",", ".")


def _sanitize(
    argv: Sequence[str],
    *,
    earlier: Sequence[RunPass],
    found: Sequence[RunDiagnosis],
    root: Path,
    options: RunOptions,
    environ: Mapping[str, str],
    on_pass: OnPass | None,
) -> tuple[tuple[RunPass, ...], SanitizerRun, tuple[RunDiagnosis, ...]]:
    """The sanitize passes (none where it could not run, two where the first, bounded by a
    launch count, failed inside compute-sanitizer), what they found, and the diagnosis the
    placed addresses give when they agree."""
    errors = [e for p in earlier for e in p.cuda_errors]
    records = [r for p in earlier for r in p.processes]
    targets = run_findings.sanitizer_targets(errors, found, records)
    if targets is None:
        return (), SanitizerRun(ran=False, note="no Triton kernel was launched: nothing to check"), ()
    # Aimed at a CUDA error, memcheck checks every launch of the target kernels up to the fault:
    # every pass with `--launch-count 2` on the example's over-routed specimen ended in "Internal
    # Sanitizer Error: failed to handle a hardware exception" with nothing found, and every pass
    # without it, whatever the kernel filter, printed the writes past `y` (H100, 2026-11-25).
    # With no fault to aim at, the count bounds the cost of a long healthy run.
    launch_count = None if errors else targets.launch_count
    try:
        info = find_compute_sanitizer(env=environ)
    except ValueError as exc:
        return (), SanitizerRun(ran=False, note=f"compute-sanitizer cannot be used: {exc}"), ()
    if info is None:
        return (), SanitizerRun(
            ran=False,
            note=(
                "compute-sanitizer was not found (looked at $QMOE_DOCTOR_COMPUTE_SANITIZER, PATH, "
                "$CUDA_HOME/$CUDA_PATH and /usr/local/cuda*): install the CUDA toolkit's "
                "compute-sanitizer or point QMOE_DOCTOR_COMPUTE_SANITIZER at it; no rerun was made"
            ),
            kernels=targets.kernels,
            launch_count=launch_count,
        ), ()
    folder = root / "sanitize"
    # the caching allocator hides out-of-bounds accesses inside its pooled segments
    extra = {knobs.PYTORCH_NO_CUDA_MEMORY_CACHING: "1"}

    def memcheck(count: int | None, where: Path, why: str) -> tuple[RunPass, _Memcheck]:
        where.mkdir(parents=True, exist_ok=True)
        full = sanitizer_command(
            info,
            SanitizerTool.MEMCHECK,
            argv,
            kernel_regex=_kernel_regex(targets.kernels),
            launch_count=count,
            log_path=where / SANITIZER_LOG,
            target_processes_all=True,
        )
        prefix = full[: len(full) - len(argv)]
        if on_pass is not None:
            on_pass("sanitize", [*prefix, *argv], why)
        done, _ = _run_pass(
            "sanitize", argv, folder=where, options=options, extra_env=extra, environ=environ, prefix=prefix
        )
        return done, _read_memcheck(where, done)

    why = f"compute-sanitizer memcheck on {', '.join(targets.kernels)} ({targets.why})"
    first, result = memcheck(launch_count, folder, why)
    first_failed = ""
    if (
        launch_count is not None
        and result.parsed is not None
        and result.parsed.tool_failures
        and not result.addresses
    ):
        # the bounded pass failed inside compute-sanitizer and found nothing: once more on the
        # same kernels, every launch (slower: the whole run of those kernels is checked)
        first_failed = result.parsed.tool_failures[0]
        second, result = memcheck(
            None,
            folder / "unbounded",
            f"{why}, every launch: the pass with --launch-count failed inside compute-sanitizer",
        )
    base = SanitizerRun(
        ran=True,
        note="",
        binary=info.path,
        version=info.version or "",
        kernels=targets.kernels,
        launch_count=None if first_failed else launch_count,
        log_path=str(folder),
    )
    before = (
        f"memcheck with --launch-count {launch_count} failed inside compute-sanitizer ({first_failed}); "
        "on every launch: "
        if first_failed
        else ""
    )
    sanitized = (first, second) if first_failed else (first,)
    if result.parsed is None:
        return sanitized, replace(
            base,
            note=f"{before}compute-sanitizer wrote no readable log ({result.problems or 'none was written'})",
        ), ()
    parsed = result.parsed
    n_errors = parsed.error_summary if parsed.error_summary is not None else parsed.records
    placed = sum(1 for a in result.addresses if a.tensor is not None)
    # the log prints its first records only, and each kind of access keeps its first 64 distinct
    # addresses (diagnose.sanitizer_log.MAX_GROUP_ADDRESSES): the addresses are those, not every error
    read = f"{placed} of the {len(result.addresses)} distinct invalid addresses read from the log placed against recorded tensors"
    if parsed.tool_failures:
        # what it printed before it gave up is kept; the rest of the run was not checked
        note = (
            f"compute-sanitizer failed: {parsed.tool_failures[0]} It printed {n_errors:,} "
            f"error{'s' if n_errors != 1 else ''} before that; {read}; what it did not check is unknown, not clean"
        )
    elif n_errors:
        note = f"{n_errors:,} error{'s' if n_errors != 1 else ''}; {read}"
    elif parsed.clean:
        note = "0 errors in the kernels checked"
    else:
        note = "the log holds no error record (the run may have been cut short)"
    placement = run_findings.placed_diagnoses(result.addresses, result.records)
    return (
        sanitized,
        replace(
            base, note=before + note, errors=n_errors, addresses=result.addresses, agreement=placement.note
        ),
        placement.diagnoses,
    )


@dataclass(frozen=True)
class _Memcheck:
    """What one memcheck pass left: its parsed logs (None: no readable log), the invalid
    addresses placed against the pass's recorded tensors, and those records."""

    parsed: SanitizerReport | None
    problems: str
    addresses: tuple[AddressNote, ...]
    records: tuple[ProcessRecord, ...] = ()


def _read_memcheck(folder: Path, done: RunPass) -> _Memcheck:
    texts: list[str] = []
    problems: list[str] = []
    for path in sorted(folder.glob(SANITIZER_LOG.replace("%p", "*"))):
        try:
            texts.append(read_text(path))
        except InputError as exc:
            problems.append(str(exc))
    if not texts:
        return _Memcheck(None, "; ".join(problems), ())
    parsed = parse_sanitizer_log("\n".join(texts))
    return _Memcheck(
        parsed, "; ".join(problems), run_findings.address_notes(parsed, done.processes), done.processes
    )


def _merged_lint(passes: Sequence[RunPass]) -> tuple[SourceLint, ...]:
    by_path: dict[str, SourceLint] = {}
    for p in passes:
        for record in p.processes:
            for lint in record.lint:
                by_path.setdefault(lint.path, lint)
    return tuple(by_path.values())


def _merged_diagnoses(passes: Sequence[RunPass]) -> tuple[RunDiagnosis, ...]:
    seen: dict[tuple[str, str, str], RunDiagnosis] = {}
    for p in passes:
        for d in run_findings.diagnoses(p.processes, p.label):
            seen.setdefault((d.cause, d.kind.value, d.kernel), d)
    return tuple(seen.values())


def _compare(
    plan: compare_flow.ReferencePlan,
    first: RunPass,
    root: Path,
    options: RunOptions,
    environ: Mapping[str, str],
    on_pass: OnPass | None,
) -> tuple[RunCompare, list[RunPass], bool]:
    """The reference passes and the compare section; whether the user interrupted them. Raises
    RunInputError for a reference that launched nothing while the subject did."""
    if not compare_flow.read_pass_prints(root / "run")[0].launches:
        return compare_flow.nothing_to_compare(plan, options.compare_launches), [], False
    done: list[tuple[RunPass, Path]] = []
    for k in range(1, plan.repeat + 1):
        if on_pass is not None:
            on_pass("reference", plan.argv, f"reference run {k} of {plan.repeat}: {plan.name}")
        folder = root / f"reference-{k}"
        ran, signalled = _run_pass(
            "reference", plan.argv, folder=folder, options=options, extra_env=plan.env, environ=environ,
            prints=options.compare_launches,
        )  # fmt: skip
        done.append((ran, folder))
        if signalled is not None:
            interrupted = RunCompare(
                kind=plan.kind, reference=plan.argv, reference_env=plan.env, repeat=len(done),
                limit=options.compare_launches, verdict="nothing compared: the reference runs were interrupted",
            )  # fmt: skip
            return interrupted, [p for p, _ in done], True
    try:
        result = compare_flow.compare_passes(plan, first, root / "run", done, limit=options.compare_launches)
    except compare_flow.CompareInputError as exc:
        raise RunInputError(str(exc)) from None
    return result, [p for p, _ in done], False


def run_program(
    argv: Sequence[str],
    options: RunOptions | None = None,
    *,
    on_pass: OnPass | None = None,
    environ: Mapping[str, str] | None = None,
) -> RunReport:
    """Run ``argv`` under the launch monitor (and the reruns ``options`` ask for); the report.
    Raises RunInputError when the command cannot be started, ValueError for a
    $QMOE_DOCTOR_COMPUTE_SANITIZER that names no executable (with ``sanitize``), both before
    anything runs."""
    options = options or RunOptions()
    env = dict(os.environ if environ is None else environ)
    command = resolve_command(argv, env)
    if options.sanitize:
        knobs.compute_sanitizer(env)  # a $QMOE_DOCTOR_COMPUTE_SANITIZER naming nothing: before the run
    plan = None
    if options.compare is not None:  # a reference that cannot run: refused before the command runs
        try:
            plan = compare_flow.reference_plan(options.compare, command, options.repeat, resolve_command, env)
        except compare_flow.CompareInputError as exc:
            raise RunInputError(str(exc)) from None
    prints = options.compare_launches if plan is not None else 0
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    t0 = time.monotonic()
    notes: list[str] = []
    with LogDir.open(options.log_dir, prefix="qmoe-doctor-run-") as logs:
        first, signalled = _run_pass(
            "run", command, folder=logs.path / "run", options=options, extra_env={}, environ=env, prints=prints
        )
        passes = [first]
        stop = signalled is not None  # the user interrupted the command: no rerun
        compared: RunCompare | None = None
        references: list[RunPass] = []
        if plan is not None and stop:
            notes.append("the command was interrupted: the reference was not run")
        elif plan is not None:
            compared, references, stop = _compare(plan, first, logs.path, options, env, on_pass)
        if stop and (options.blocking or options.sanitize):
            notes.append("the command was interrupted: the reruns asked for were not made")
        if options.blocking and not stop:
            if first.cuda_errors or any(r.end is None for r in first.processes):
                if on_pass is not None:
                    on_pass("blocking", command, "CUDA_LAUNCH_BLOCKING=1: the launch that faults raises")
                blocking, signalled = _run_pass(
                    "blocking",
                    command,
                    folder=logs.path / "blocking",
                    options=options,
                    extra_env={knobs.CUDA_LAUNCH_BLOCKING: "1"},
                    environ=env,
                )
                passes.append(blocking)
                stop = signalled is not None
            else:
                notes.append("--blocking: the run met no CUDA error, so it was not rerun")
        found = _merged_diagnoses(passes)
        sanitizer: SanitizerRun | None = None
        if options.sanitize and not stop:
            sanitized, sanitizer, placed = _sanitize(
                command,
                earlier=passes,
                found=found,
                root=logs.path,
                options=options,
                environ=env,
                on_pass=on_pass,
            )
            if sanitized:
                passes.extend(sanitized)
                found = (*_merged_diagnoses(passes), *placed)
        if not first.processes:
            notes.append("no process of the command imported Triton: no launch was monitored")
        report = RunReport(
            command=tuple(command),
            started=started,
            wall_s=round(time.monotonic() - t0, 3),
            exit_code=first.exit_code,
            command_exit=first.exit_code,
            passes=tuple(passes),
            diagnoses=found,
            lint=_merged_lint(passes),
            sanitizer=sanitizer,
            notes=tuple(notes),
            compare=compared,
            reference_passes=tuple(references),
        )
        if not report.healthy or first.exit_code != 0:
            logs.keep()
    code = report.command_exit
    if (options.fail_on_finding or options.strict) and code == 0 and not report.healthy:
        code = int(ExitCode.FAULT)
    return replace(report, exit_code=code, record_dir=logs.reported)


__all__ = [
    "OnPass",
    "RunInputError",
    "RunOptions",
    "bootstrap_dir",
    "monitor_env",
    "package_home",
    "read_records",
    "resolve_command",
    "run_program",
]
