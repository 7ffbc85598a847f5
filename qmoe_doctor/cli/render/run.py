"""Rendering of a ``qmoe-doctor run`` report: what the monitor saw, after the command's own output.

Plain text through ``Text`` (markup off: kernel names, paths and exception texts are the
user's). Order: one line on the command, the diagnoses (each with its confidence and how it was
reached, its launch, call site and the user's own line, tensors, the scan that proves it and the
fix as code), the CUDA errors with the launches before them, the sanitizer's attributed addresses
and what they say together, the lint of the launched kernels, the notes.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from qmoe_doctor.cli.render.run_compare import render_compare
from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.launches import FindingKind, Launch, LaunchFinding, ProcessRecord, SourceSite, TensorArg
from qmoe_doctor.core.reports import RunCudaError, RunDiagnosis, RunPass, RunReport

_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
#: Lint findings listed before "... and N more".
LINT_SHOWN = 12


def _tensor(t: TensorArg) -> str:
    dims = " x ".join(str(d) for d in t.shape) or "scalar"
    return f"{t.name} ({dims} {_DTYPE_SHORT.get(t.dtype, t.dtype)}) on {t.device}"


def _launch_line(launch: Launch) -> str:
    grid = f" grid {launch.grid}" if launch.grid is not None else ""
    device = f" on {launch.device}" if launch.device else " (interpreter)"
    stream = f" stream 0x{launch.stream:x}" if launch.stream else ""
    thread = f" [thread {launch.thread}]" if launch.thread else ""
    raised = f"  raised: {launch.raised}" if launch.raised else ""
    return f"#{launch.seq} {launch.kernel} (launch {launch.kernel_seq} of it){grid}{device}{stream}{thread}{raised}"


def _processes_line(processes: tuple[ProcessRecord, ...]) -> str:
    launching = [r for r in processes if r.launches]
    if not processes:
        return "no process imported Triton"
    parts = []
    for r in launching[:6]:
        kernels = len(r.kernels)
        launches = f"{r.launches:,} launch{'es' if r.launches != 1 else ''}"
        parts.append(f"{r.label}: {launches} of {kernels} kernel{'s' if kernels != 1 else ''}")
    more = f", and {len(launching) - 6} more" if len(launching) > 6 else ""
    idle = len(processes) - len(launching)
    quiet = f"; {idle} more imported Triton and launched nothing" if idle else ""
    hooks = sorted({h.value for r in processes for h in r.hooks})
    return f"{'; '.join(parts) or 'no launch'}{more}{quiet} (hooks: {', '.join(hooks) or 'none'})"


def _user_line(launch: Launch, shown: SourceSite | None) -> SourceSite | None:
    """The user's own line, when it is not the line already shown (a library's wrapper)."""
    return launch.user_site if launch.user_site is not None and launch.user_site != shown else None


def _outcome(f: LaunchFinding) -> str:
    return {
        "ran": "it ran (over peer access the kernel reads the other GPU remotely)"
        if f.launch_device and f.kind.value in ("tensor-on-other-device", "rank-on-device-0")
        else "it ran",
        "refused": "Triton refused the pointer (no peer access): the launch raised",
        "raised": "the launch raised",
        "stopped": "stopped before the launch by --strict",
        "pending": "",
    }[f.outcome]


def render_diagnosis(out: Console, d: RunDiagnosis) -> None:
    f = d.finding
    head = Text(f"{d.cause}", style="bold red")
    basis = f": {d.basis}" if d.basis else ""
    head.append(f"  [{d.kind.value}, {d.confidence.value} confidence{basis}]", style="dim")
    out.print(head, soft_wrap=True)
    out.print(Text(f"  {d.summary}"), soft_wrap=True)
    launch = f.launch
    if launch is not None:
        out.print(Text(f"  launch: {_launch_line(launch)}", style="dim"), soft_wrap=True)
        if launch.call_site is not None:
            out.print(Text(f"  called at: {launch.call_site.render()}", style="bold"), soft_wrap=True)
        mine = _user_line(launch, launch.call_site)
        if mine is not None:
            out.print(Text(f"  your line: {mine.render()}", style="bold"), soft_wrap=True)
        if launch.launch_site is not None and launch.launch_site != launch.call_site:
            out.print(Text(f"  launched at: {launch.launch_site.render()}"), soft_wrap=True)
    for t in f.tensors:
        out.print(Text(f"  tensor: {_tensor(t)}"), soft_wrap=True)
    outcome = _outcome(f) if d.kind is not FindingKind.PLACED_ACCESS else ""
    if outcome:
        out.print(Text(f"  outcome: {outcome}"), soft_wrap=True)
    for note in f.lint:
        out.print(Text(f"  lint: {note.path}:{note.line}: {note.message}", style="dim"), soft_wrap=True)
    seen = f"  seen in {', '.join(d.processes)}: {d.launches:,} launch{'es' if d.launches != 1 else ''}"
    if d.seen_in != "run":
        seen += f" ({d.seen_in} pass)"
    out.print(Text(seen, style="dim"), soft_wrap=True)
    if d.repro:
        out.print(Text(f"  prove it: {d.repro}", style="bold"), soft_wrap=True)
    cause = CAUSES.get(d.cause)
    if cause is not None:
        out.print(Text("  fix:", style="bold green"))
        for line in cause.fix.splitlines():
            out.print(Text(f"    {line}", style="green"), soft_wrap=True)
        out.print(Text(f"  more: {cause.docs}", style="dim"))


def render_cuda_error(out: Console, label: str, e: RunCudaError) -> None:
    out.print(Text(f"CUDA error in {e.process} ({label} pass)", style="bold red"))
    out.print(Text(f"  {e.message}"), soft_wrap=True)
    if e.faulting and e.exact:
        out.print(Text(f"  faulting kernel: {e.faulting}", style="bold"), soft_wrap=True)
    if e.note:
        out.print(Text(f"  {e.note}", style="dim"), soft_wrap=True)
    if e.last_launches:
        out.print(Text("  last launches, oldest first:"))
        for launch in e.last_launches:
            out.print(Text(f"    {_launch_line(launch)}"), soft_wrap=True)
            site = launch.call_site or launch.launch_site
            if site is not None:
                out.print(Text(f"      at {site.render()}", style="dim"), soft_wrap=True)
            mine = _user_line(launch, site)
            if mine is not None:
                out.print(Text(f"      your line: {mine.render()}", style="dim"), soft_wrap=True)


def _pass_line(p: RunPass) -> Text:
    text = Text(f"{p.label}: ", style="bold")
    text.append(f"{p.end} in {p.wall_s:.1f} s; ")
    text.append(_processes_line(p.processes))
    return text


def render_run(out: Console, report: RunReport) -> None:
    out.print(Text(f"qmoe-doctor run: {' '.join(report.command)}", style="bold"), soft_wrap=True)
    for p in report.passes:
        out.print(_pass_line(p), soft_wrap=True)
        for env, value in p.env.items():
            out.print(Text(f"  with {env}={value}", style="dim"))
    for d in report.diagnoses:
        render_diagnosis(out, d)
    for p in report.passes:
        if p.label == "sanitize":
            continue  # under memcheck the error is the tool's stop; its records follow below
        for e in p.cuda_errors:
            render_cuda_error(out, p.label, e)
    render_compare(out, report)
    s = report.sanitizer
    if s is not None:
        style = "bold" if s.ran else "yellow"
        out.print(Text(f"compute-sanitizer: {s.note}", style=style), soft_wrap=True)
        if s.kernels:
            out.print(
                Text(
                    f"  kernels: {', '.join(s.kernels)}"
                    + (
                        f"; --launch-count {s.launch_count}"
                        if s.launch_count is not None
                        else "; every launch up to the fault"
                    ),
                    style="dim",
                ),
                soft_wrap=True,
            )
        for a in s.addresses[:8]:
            out.print(
                Text(f"  0x{a.address:x} ({a.access}{', in ' + a.kernel if a.kernel else ''}):"),
                soft_wrap=True,
            )
            for sentence in a.sentences[:3]:
                out.print(Text(f"    {sentence}"), soft_wrap=True)
        if s.agreement:
            out.print(Text(f"  together: {s.agreement}", style="bold"), soft_wrap=True)
        if s.log_path:
            out.print(Text(f"  log: {s.log_path}", style="dim"), soft_wrap=True)
    findings = [f for lint in report.lint for f in lint.findings]
    if findings:
        out.print(Text(f"Lint of the sources that launched kernels: {len(findings)} findings", style="bold"))
        for f in findings[:LINT_SHOWN]:
            out.print(Text(f"  {f.path}:{f.line}: {f.rule} [{f.cause}] {f.message}"), soft_wrap=True)
        if len(findings) > LINT_SHOWN:
            out.print(Text(f"  ... and {len(findings) - LINT_SHOWN} more (--json has them all)", style="dim"))
    for p in report.passes:
        for note in p.notes:
            out.print(Text(f"note ({p.label}): {note}", style="yellow"), soft_wrap=True)
        for r in p.processes:
            for problem in r.problems:
                out.print(Text(f"note ({r.label}): the monitor: {problem}", style="yellow"), soft_wrap=True)
    for note in report.notes:
        out.print(Text(f"note: {note}", style="yellow"), soft_wrap=True)
    if report.record_dir:
        out.print(Text(f"records: {report.record_dir}", style="dim"), soft_wrap=True)
    out.print(summary_line(report))


def summary_line(report: RunReport) -> Text:
    """The last line. "No finding" only when nothing was found: no diagnosis, no CUDA error in
    any pass, no error of compute-sanitizer's; a command that failed anyway says so."""
    launched = any(r.launches for p in report.passes for r in p.processes)
    if report.healthy:
        ended = report.passes[0].end if report.passes else f"exit {report.command_exit}"
        caveat = f"; the command itself failed ({ended})" if report.command_exit != 0 else ""
        if not launched:
            return Text("No Triton launch was monitored" + caveat + ".", style="yellow")
        if report.compare is not None and report.compare.nothing_compared:
            caveat += "; the compare pass compared no launch"
        if caveat:
            return Text("No finding in the monitored launches" + caveat + ".", style="yellow")
        return Text("No finding: every monitored launch kept its tensors on its device.", style="green")
    n = len(report.diagnoses)
    errors = len(report.cuda_errors)
    parts = [f"{n} diagnos{'is' if n == 1 else 'es'}", f"{errors} CUDA error{'s' if errors != 1 else ''}"]
    if report.sanitizer_errors:
        k = report.sanitizer_errors
        parts.append(f"{k:,} compute-sanitizer error{'s' if k != 1 else ''}")
    if report.compare is not None and report.compare.diverged:
        parts.append("1 divergent launch")
    return Text(f"{', '.join(parts)}; exit {report.exit_code}", style="bold red")


__all__ = ["render_cuda_error", "render_diagnosis", "render_run", "summary_line"]
