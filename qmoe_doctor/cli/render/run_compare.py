"""Rendering of a run report's compare section (``run --compare``): the reference passes, the
processes matched, the verdict, the first divergent launch with the measures its fingerprints
give (named by what they are), the first nondeterministic one, the scan that proves it.

Plain text through ``Text`` (markup off: kernel names and paths are the user's).
"""

from __future__ import annotations

import math

from rich.console import Console
from rich.text import Text

from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.compare import CompareKind, LaunchDifference, RunCompare, TensorDelta
from qmoe_doctor.core.fingerprints import SAMPLE_HASHED, LaunchPrint
from qmoe_doctor.core.launches import DEFAULT_STREAMS
from qmoe_doctor.core.reports import RunPass, RunReport

_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def _g(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.4g}"


def _launch(launch: LaunchPrint) -> str:
    grid = f" grid {launch.grid}" if launch.grid is not None else ""
    device = f" on {launch.device}" if launch.device else " (interpreter)"
    stream = ""
    if launch.stream is not None:
        stream = " default stream" if launch.stream in DEFAULT_STREAMS else f" stream 0x{launch.stream:x}"
    thread = f" [thread {launch.thread}]" if launch.thread else ""
    return f"#{launch.seq} {launch.kernel} (launch {launch.ordinal} of it){grid}{device}{stream}{thread}"


def _tensors(a: LaunchPrint, b: LaunchPrint) -> str:
    parts = []
    for ta, tb in zip(a.tensors, b.tensors, strict=False):
        dims = " x ".join(str(d) for d in ta.shape) or "scalar"
        other = f" (reference: {tb.device})" if tb.device != ta.device else ""
        parts.append(f"{ta.name} ({dims} {_DTYPE_SHORT.get(ta.dtype, ta.dtype)}) on {ta.device}{other}")
    return "; ".join(parts) or "none"


def delta_line(d: TensorDelta) -> str:
    """One tensor's difference, each measure named by what it is (a fingerprint holds sums and
    sampled values, not every element)."""
    read = "after the launch" if d.phase == "after" else "before the launch"
    scale = d.reference.total_abs
    rel = f", {_g(abs(d.sum_delta) / scale)} of its sum of |x|" if scale and not math.isnan(scale) else ""
    parts = [
        f"sum {_g(d.subject.total)} vs {_g(d.reference.total)} (difference {_g(d.sum_delta)}{rel})",
        f"sum of |x| {_g(d.subject.total_abs)} vs {_g(d.reference.total_abs)}",
        f"non-finite {d.subject.nonfinite:,} vs {d.reference.nonfinite:,}",
    ]
    if d.sample_kept:
        sampled = (
            f"{d.sample_differing} of {d.sample_kept} kept sampled values differ: max |d| {_g(d.sample_max_abs)}, "
            f"mean |d| {_g(d.sample_mean_abs)}"
        )
        if d.sample_max_rel is not None:
            sampled += f", max |d|/|reference| {_g(d.sample_max_rel)}"
        parts.append(sampled)
    hashed = min(d.numel, SAMPLE_HASHED)
    parts.append(f"the {hashed:,} sampled values {'differ' if d.hash_differs else 'are equal'}")
    parts.append(f"mean |d| over all {d.numel:,} elements >= {_g(d.mean_abs_lower_bound)} (from the sums)")
    if d.tolerance is not None:
        parts.append(f"tolerance on the sum {_g(d.tolerance)} (nondeterministic)")
    return f"{d.name} ({read}): " + "; ".join(parts)


def _difference(out: Console, title: str, d: LaunchDifference, style: str) -> None:
    out.print(Text(f"  {title}: {_launch(d.launch)} in {d.process}", style=style), soft_wrap=True)
    site = d.launch.call_site
    other = d.other.call_site
    if site is not None:
        again = "" if other == site else f" (reference: {other.render()})" if other is not None else ""
        out.print(Text(f"    called at: {site.render()}{again}", style="bold"), soft_wrap=True)
    if d.launch.launch_site is not None and d.launch.launch_site != site:
        out.print(Text(f"    launched at: {d.launch.launch_site.render()}"), soft_wrap=True)
    if d.other.device != d.launch.device or d.other.stream != d.launch.stream:
        out.print(Text(f"    in the reference: {_launch(d.other)}", style="dim"), soft_wrap=True)
    out.print(Text(f"    tensors: {_tensors(d.launch, d.other)}", style="dim"), soft_wrap=True)
    if d.arguments:
        out.print(Text(f"    arguments differ: {d.arguments}"), soft_wrap=True)
    for delta in d.deltas:
        out.print(Text(f"    {delta_line(delta)}"), soft_wrap=True)
    for delta in d.written_before:
        if delta not in d.deltas:
            out.print(Text(f"    {delta_line(delta)}", style="dim"), soft_wrap=True)
    if d.previous is not None:
        out.print(Text(f"    last matched launch: {_launch(d.previous)}"), soft_wrap=True)
    else:
        out.print(
            Text("    last matched launch: none (it is the process's first printed launch)"), soft_wrap=True
        )


def _pass_line(p: RunPass, k: int) -> str:
    launching = [r for r in p.processes if r.launches]
    launches = sum(r.launches for r in launching)
    return f"reference run {k}: {p.end} in {p.wall_s:.1f} s; {launches:,} launches in {len(launching)} process(es)"


def render_compare(out: Console, report: RunReport) -> None:
    c: RunCompare | None = report.compare
    if c is None:
        return
    what = {
        CompareKind.BLOCKING: "blocking: the command with CUDA_LAUNCH_BLOCKING=1",
        CompareKind.REPEAT: "repeat: the command again",
        CompareKind.COMMAND: f"the command {' '.join(c.reference)}",
    }[c.kind]
    out.print(
        Text(
            f"compare with {what}: {c.repeat} reference run{'s' if c.repeat != 1 else ''}, the first {c.limit:,} "
            "launches of each kernel per process fingerprinted",
            style="bold",
        ),
        soft_wrap=True,
    )
    for k, p in enumerate(report.reference_passes, 1):
        out.print(Text(f"  {_pass_line(p, k)}", style="dim"), soft_wrap=True)
    for proc in c.processes:
        refs = ", ".join(r or "none" for r in proc.references)
        line = f"  {proc.subject} against {refs}: {proc.compared:,} of {proc.printed:,} printed launches compared"
        if proc.nondeterministic:
            line += f", {proc.nondeterministic:,} nondeterministic ({proc.nondeterministic_in_kernel:,} in the kernel)"
        if proc.divergent:
            line += f", {proc.divergent:,} divergent"
        out.print(Text(line, style="dim"), soft_wrap=True)
        if proc.stop:
            out.print(
                Text(f"    the launch sequences stop matching {proc.stop}", style="yellow"), soft_wrap=True
            )
    style = (
        "bold red" if c.diverged
        else "bold yellow" if c.nothing_compared or c.nondeterminism is not None
        else "bold green"
    )  # fmt: skip
    out.print(Text(f"  verdict: {c.verdict}", style=style), soft_wrap=True)
    if c.divergence is not None:
        _difference(out, "first divergent launch", c.divergence, "bold")
    for line in c.explanation:
        out.print(Text(f"    {line}"), soft_wrap=True)
    if c.cause is not None:
        confidence = f" ({c.confidence.value} confidence)" if c.confidence is not None else ""
        out.print(Text(f"  cause: {c.cause}{confidence}", style="bold red"), soft_wrap=True)
        cause = CAUSES.get(c.cause)
        if cause is not None:
            out.print(Text("  fix:", style="bold green"))
            for line in cause.fix.splitlines():
                out.print(Text(f"    {line}", style="green"), soft_wrap=True)
            out.print(Text(f"  more: {cause.docs}", style="dim"))
    if c.scan:
        out.print(Text(f"  prove it on the extracted kernel: {c.scan}", style="bold"), soft_wrap=True)
    elif c.scan_note:
        out.print(Text(f"  no scan command: {c.scan_note}", style="dim"), soft_wrap=True)
    if c.nondeterminism is not None:
        n = c.nondeterminism
        _difference(out, "first nondeterministic launch (between runs of the same command)", n, "yellow")
        for line in c.nondeterminism_explanation:
            out.print(Text(f"    {line}", style="dim"), soft_wrap=True)
    if c.tolerance:
        out.print(Text(f"  tolerance: {c.tolerance}", style="dim"), soft_wrap=True)
    for note in c.notes:
        out.print(Text(f"note (compare): {note}", style="yellow"), soft_wrap=True)


__all__ = ["delta_line", "render_compare"]
