"""``qmoe-doctor run --compare``: the subject's launches against the reference's, from their
fingerprints (``core.fingerprints``). Pure functions over recorded prints.

::

    [PassPrints] subject, references (--repeat N)
      match processes (by rank, else by start order)
      align each process's printed launches: position by position while kernel, ordinal and
        config agree in every run; where they stop agreeing is said, nothing past it compared
      noise: a launch whose prints differ between the reference runs is nondeterministic; its
        tensors are compared within FACTOR x the largest spread the reference runs showed for
        that kernel's argument (relative to its sum of |x|)
      the first divergent launch: inputs (tensors it only reads, and its grid and scalars)
        already different -> "before"; else outputs different -> "in-kernel"
      the verdict, a cause id from the launch's devices and streams, and the scan command
    --> core.compare.RunCompare

A tensor's *relevant* read is the one after the launch when some run's launch wrote it (its
contents after differ from before), else the one before it. A written tensor's contents before
the launch (``torch.empty`` memory, or an accumulator) are reported when they differ, never
counted as an input: that is "undecided" when nothing else differs before the launch.
"""

from __future__ import annotations

import ast
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qmoe_doctor.core.compare import (
    CompareKind,
    CompareProcesses,
    DifferenceWhere,
    LaunchDifference,
    Phase,
    RunCompare,
    TensorDelta,
)
from qmoe_doctor.core.fingerprints import Contents, LaunchPrint, ProcessPrints, TensorPrint
from qmoe_doctor.core.launches import DEFAULT_STREAMS, SourceSite
from qmoe_doctor.core.records import Confidence

#: A nondeterministic launch's tensor diverges when its sum (or sum of |x|) lies farther than
#: FACTOR x the largest relative spread the reference runs showed for that kernel's argument,
#: times its sum of |x|, outside the references' range. Two runs estimate a spread poorly: the
#: largest over every noisy launch of the kernel is taken, and a factor above it.
FACTOR = 8.0
#: ... and never tighter than this fraction of its sum of |x|: two runs estimate a spread so
#: poorly that a third lands far outside it often (measured on the CPU: about one run in ten with
#: noise drawn uniformly and carried through four launches). Rounding-order noise (atomic adds,
#: split-K) stays far below it; a race that changes a tensor's values is far above it.
NOISE_FLOOR = 1e-3
#: Cause -> (GPUs, scan conditions) of the scan that proves it on the extracted kernel.
SCAN_CONDITIONS = {
    "wrong-device-stream": ("single", "single,side-stream"),
    "cross-device-stream-race": ("pair", "guarded,peer,producer-race,sizes-race"),
    "missing-device-guard": ("pair", "guarded,untouched,no-peer,peer"),
    "default-device-buffer": ("pair", "guarded,untouched,no-peer,peer"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessRun:
    """One process's prints in one pass."""

    label: str  # "rank 0 (pid 11)"
    rank: int | None
    prints: ProcessPrints


@dataclass(frozen=True, slots=True, kw_only=True)
class PassPrints:
    """One pass's processes that printed launches, in rank then start order."""

    processes: tuple[ProcessRun, ...] = ()

    @property
    def launches(self) -> int:
        return sum(len(p.prints.launches) for p in self.processes)


# --- matching ---------------------------------------------------------------------------------


def match_processes(
    subject: PassPrints, references: Sequence[PassPrints]
) -> tuple[list[tuple[ProcessRun, list[ProcessRun | None]]], list[str]]:
    """Pair each subject process with one process of each reference run: by rank when every
    process has one, else by order. Notes say what is left unpaired."""
    runs = [subject, *references]
    by_rank = all(p.rank is not None for run in runs for p in run.processes)
    pairs: list[tuple[ProcessRun, list[ProcessRun | None]]] = []
    notes: list[str] = []
    for i, s in enumerate(subject.processes):
        matched: list[ProcessRun | None] = []
        for ref in references:
            if by_rank:
                matched.append(next((p for p in ref.processes if p.rank == s.rank), None))
            else:
                matched.append(ref.processes[i] if i < len(ref.processes) else None)
        pairs.append((s, matched))
    counts = [len(run.processes) for run in runs]
    if len(set(counts)) > 1:
        shown = ", ".join(f"reference run {k}: {c}" for k, c in enumerate(counts[1:], 1))
        notes.append(
            f"the runs printed launches in different numbers of processes (subject: {counts[0]}, {shown}): "
            f"processes were matched by {'rank' if by_rank else 'start order'}, the others are not compared"
        )
    return pairs, notes


def _key(launch: LaunchPrint) -> tuple[str, int]:
    return (launch.kernel, launch.ordinal)


def _describe(launch: LaunchPrint) -> str:
    return f"`{launch.kernel}` (its launch {launch.ordinal})"


def align(runs: Sequence[Sequence[LaunchPrint]], names: Sequence[str]) -> tuple[int, str]:
    """How many leading launches agree in every run (kernel, ordinal, config, tensor names), and
    where and why they stop agreeing ("" when they never stop). ``names``: each run's name."""
    shortest = min(len(r) for r in runs)
    first = runs[0]
    for i in range(shortest):
        a = first[i]
        for r, name in zip(runs[1:], names[1:], strict=True):
            b = r[i]
            where = f"at launch #{a.seq} of {names[0]} (#{b.seq} of {name})"
            if _key(a) != _key(b):
                return i, f"{where}: {names[0]} launched {_describe(a)}, {name} {_describe(b)}"
            if a.config is not None and b.config is not None and a.config != b.config:
                return i, (
                    f"{where}: {_describe(a)} ran with {a.config or 'no constexpr'} in {names[0]} and "
                    f"{b.config or 'no constexpr'} in {name} (another autotune choice, or another shape)"
                )
            if [t.name for t in a.tensors] != [t.name for t in b.tensors]:
                return i, f"{where}: {_describe(a)} took other tensor arguments in {name}"
    longest = max(len(r) for r in runs)
    if shortest == longest:
        return shortest, ""
    ended = [name for r, name in zip(runs, names, strict=True) if len(r) == shortest]
    more = [(name, r[shortest]) for r, name in zip(runs, names, strict=True) if len(r) > shortest]
    name, nxt = more[0]
    return shortest, (
        f"after {shortest} launches: {', '.join(ended)} printed no more, {name} went on with "
        f"{_describe(nxt)} (#{nxt.seq})"
    )


# --- measures ---------------------------------------------------------------------------------


def _distance(value: float, others: Sequence[float]) -> float:
    """How far ``value`` lies outside the range of ``others`` (0 inside it; inf for a NaN on one
    side only)."""
    nans = [math.isnan(o) for o in others]
    if math.isnan(value):
        return 0.0 if all(nans) else math.inf
    if any(nans):
        return math.inf
    lo, hi = min(others), max(others)
    if lo <= value <= hi:
        return 0.0
    return min(abs(value - lo), abs(value - hi))


def _spread(values: Sequence[float]) -> float:
    if any(math.isnan(v) for v in values):
        return math.inf if not all(math.isnan(v) for v in values) else 0.0
    return max(values) - min(values)


def _relevant(tensors: Sequence[TensorPrint]) -> tuple[Phase, list[Contents]]:
    """The read compared for one tensor across runs: after the launch when some run wrote it."""
    if any(t.written for t in tensors):
        return "after", [t.final for t in tensors]
    return "before", [t.before for t in tensors]


def _reproducible(contents: Sequence[Contents]) -> bool:
    """Whether two runs agree on these contents: a written tensor's contents before its launch
    count as evidence only then (else they are uninitialized memory, ``torch.empty``'s, which
    differs from process to process)."""
    return any(a.same(b) for i, a in enumerate(contents) for b in contents[i + 1 :])


def _all_same(contents: Sequence[Contents]) -> bool:
    return all(c.same(contents[0]) for c in contents[1:])


def _abs_diff(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b)


def tensor_delta(
    a: TensorPrint, b: TensorPrint, phase: Phase, written: bool, tolerance: float | None = None
) -> TensorDelta:
    """How ``a`` (subject) and ``b`` (reference) differ in ``phase``, by what prints hold."""
    ca = a.final if phase == "after" else a.before
    cb = b.final if phase == "after" else b.before
    diffs = [_abs_diff(x, y) for x, y in zip(ca.sample, cb.sample, strict=False)]
    rels = [d / abs(y) for d, y in zip(diffs, cb.sample, strict=False) if y and not math.isnan(y)]
    bound = (
        max(_abs_diff(ca.total, cb.total), _abs_diff(ca.total_abs, cb.total_abs)) / a.numel
        if a.numel
        else 0.0
    )
    return TensorDelta(
        name=a.name,
        device=a.device,
        other_device=b.device,
        dtype=a.dtype,
        shape=a.shape,
        numel=a.numel,
        phase=phase,
        subject=ca,
        reference=cb,
        written=written,
        sample_max_abs=max(diffs, default=0.0),
        sample_mean_abs=sum(diffs) / len(diffs) if diffs else 0.0,
        sample_max_rel=max(rels) if rels else None,
        sample_differing=sum(1 for d in diffs if d),
        sample_kept=len(diffs),
        mean_abs_lower_bound=bound,
        tolerance=tolerance,
    )


#: (kernel, tensor name, phase) -> the largest relative spread of (sum, sum |x|) between reference runs
Noise = dict[tuple[str, str, Phase], tuple[float, float]]


def _rel(spread: float, scale: float) -> float:
    if math.isinf(spread):
        return math.inf
    return spread / scale if scale > 0 else (0.0 if spread == 0 else math.inf)


def noise(positions: Sequence[Sequence[LaunchPrint]]) -> Noise:
    """The largest relative spreads between runs (each position: one launch in every run), per
    kernel, tensor name and phase."""
    out: Noise = {}
    for launches in positions:
        for j in range(len(launches[0].tensors)):
            phase, contents = _relevant([launch.tensors[j] for launch in launches])
            if _all_same(contents):
                continue
            scale = max((abs(c.total_abs) for c in contents if not math.isnan(c.total_abs)), default=0.0)
            rel = (
                _rel(_spread([c.total for c in contents]), scale),
                _rel(_spread([c.total_abs for c in contents]), scale),
            )
            key = (launches[0].kernel, launches[0].tensors[j].name, phase)
            old = out.get(key, (0.0, 0.0))
            out[key] = (max(old[0], rel[0]), max(old[1], rel[1]))
    return out


def _beyond(
    subject: Contents, references: Sequence[Contents], rel: tuple[float, float]
) -> tuple[bool, float | None]:
    """Whether ``subject`` differs from ``references``: exactly when this kernel argument never
    differed between reference runs (``rel`` (0, 0)), else beyond FACTOR x its pooled relative
    spread ``rel``; the tolerance on |d sum| used. A kernel whose argument is nondeterministic at
    some launch is so at all of them: two runs that happen to agree at one launch say little."""
    if rel == (0.0, 0.0) and _all_same(references):
        return not subject.same(references[0]), None
    scale = max((abs(c.total_abs) for c in references if not math.isnan(c.total_abs)), default=0.0)
    tol_total = max(FACTOR * rel[0], NOISE_FLOOR) * scale
    tol_abs = max(FACTOR * rel[1], NOISE_FLOOR) * scale
    counts = [c.nonfinite for c in references]
    out = (
        _distance(subject.total, [c.total for c in references]) > tol_total
        or _distance(subject.total_abs, [c.total_abs for c in references]) > tol_abs
        or not min(counts) <= subject.nonfinite <= max(counts)
    )
    return out, tol_total


def _arguments(a: LaunchPrint, b: LaunchPrint) -> str:
    parts = []
    if a.grid != b.grid:
        parts.append(f"grid {a.grid} vs {b.grid}")
    if a.scalars is not None and b.scalars is not None and a.scalars != b.scalars:
        parts.append(f"scalars ({a.scalars}) vs ({b.scalars})")
    return "; ".join(parts)


def _where(
    deltas: Sequence[TensorDelta], written_before: Sequence[TensorDelta], arguments: str
) -> DifferenceWhere:
    if arguments or any(not d.written for d in deltas):
        return "before"
    if written_before:
        return "undecided"
    return "in-kernel"


def difference(
    process: str,
    runs: Sequence[LaunchPrint],
    differs: Callable[[int, Phase, list[Contents]], tuple[bool, float | None]],
    *,
    other: int,
    previous: LaunchPrint | None,
    noisy: bool,
    position: int,
) -> LaunchDifference | None:
    """The difference between ``runs[0]`` and ``runs[other]`` at one launch, tested per tensor by
    ``differs(j, phase, contents of every run)``; None when nothing differs."""
    a, b = runs[0], runs[other]
    deltas: list[TensorDelta] = []
    written_before: list[TensorDelta] = []
    for j, (ta, tb) in enumerate(zip(a.tensors, b.tensors, strict=True)):
        phase, contents = _relevant([r.tensors[j] for r in runs])
        written = phase == "after"
        hit, tolerance = differs(j, phase, contents)
        if hit:
            deltas.append(tensor_delta(ta, tb, phase, written, tolerance))
        if written and not ta.before.same(tb.before) and _reproducible([r.tensors[j].before for r in runs]):
            written_before.append(tensor_delta(ta, tb, "before", written))
    arguments = _arguments(a, b)
    if not deltas and not arguments:
        return None
    return LaunchDifference(
        process=process,
        launch=a,
        other=b,
        where=_where(deltas, written_before, arguments),
        deltas=tuple(deltas),
        written_before=tuple(written_before),
        arguments=arguments,
        previous=previous,
        noisy=noisy,
        position=position,
    )


def _noisy(runs: Sequence[LaunchPrint]) -> int | None:
    """The first run that differs from ``runs[0]`` at this launch (prints or arguments), or None."""
    for k in range(1, len(runs)):
        if _arguments(runs[0], runs[k]):
            return k
        for j in range(len(runs[0].tensors)):
            phase, contents = _relevant([r.tensors[j] for r in runs])
            if not contents[k].same(contents[0]):
                return k
    return None


# --- the comparison ------------------------------------------------------------------------


@dataclass(slots=True)
class _Pair:
    label: str
    names: list[str]
    runs: list[Sequence[LaunchPrint]]
    n: int
    stop: str
    references: tuple[str, ...]


def _pairs(subject: PassPrints, references: Sequence[PassPrints]) -> tuple[list[_Pair], list[str]]:
    matched, notes = match_processes(subject, references)
    pairs = []
    for s, refs in matched:
        present = [(k, r) for k, r in enumerate(refs, 1) if r is not None]
        names = ["the subject", *(f"reference run {k}" for k, _ in present)]
        runs: list[Sequence[LaunchPrint]] = [s.prints.launches, *(r.prints.launches for _, r in present)]
        if present:
            n, stop = align(runs, names)
        else:
            n, stop = 0, "no process of the reference matched it"
        pairs.append(
            _Pair(
                label=s.label,
                names=names,
                runs=runs,
                n=n,
                stop=stop,
                references=tuple(r.label if r is not None else "" for r in refs),
            )  # fmt: skip
        )
    return pairs, notes


def compare_prints(
    kind: CompareKind,
    subject: PassPrints,
    references: Sequence[PassPrints],
    *,
    reference: Sequence[str],
    reference_env: dict[str, str],
    limit: int,
    read_source: Callable[[str], str | None] | None = None,
    cwd: str | None = None,
) -> RunCompare:
    """Compare the subject's prints with the reference runs'. ``read_source`` reads a source
    file for the scan suggestion (None: no suggestion)."""
    pairs, notes = _pairs(subject, references)
    peers = kind is CompareKind.REPEAT  # every run is the same command: all of them are references
    pooled: Noise = {}
    for pair in pairs:
        start = 0 if peers else 1
        positions = [[run[i] for run in pair.runs[start:]] for i in range(pair.n)]
        if positions and len(positions[0]) > 1:
            for key, rel in noise(positions).items():
                old = pooled.get(key, (0.0, 0.0))
                pooled[key] = (max(old[0], rel[0]), max(old[1], rel[1]))
    summaries: list[CompareProcesses] = []
    divergence: LaunchDifference | None = None
    divergent_launches: Sequence[LaunchPrint] = ()
    nondeterminism: LaunchDifference | None = None
    for pair in pairs:
        divergent = nondeterministic = in_kernel = 0
        first_divergent = first_nondeterministic = None
        for i in range(pair.n):
            runs = [run[i] for run in pair.runs]
            previous = pair.runs[0][i - 1] if i else None
            refs = runs if peers else runs[1:]
            noisy_at = _noisy(refs) if len(refs) > 1 else None
            if noisy_at is not None:
                nondeterministic += 1
                shown = [refs[0], refs[noisy_at]]
                found_noise = difference(
                    pair.label if peers else pair.references[0] or pair.label, shown,
                    lambda j, phase, contents: (not contents[1].same(contents[0]), None),
                    other=1, previous=pair.runs[1 if not peers else 0][i - 1] if i else None,
                    noisy=True, position=i + 1,
                )  # fmt: skip
                if found_noise is not None and found_noise.where == "in-kernel":
                    in_kernel += 1
                if first_nondeterministic is None:
                    first_nondeterministic = refs[0].seq
                    if nondeterminism is None:
                        nondeterminism = found_noise
            if peers:
                continue
            kernel = runs[0].kernel

            def differs(
                j: int,
                phase: Phase,
                contents: list[Contents],
                kernel: str = kernel,
                runs: list[LaunchPrint] = runs,
            ) -> tuple[bool, float | None]:
                rel = pooled.get((kernel, runs[0].tensors[j].name, phase), (0.0, 0.0))
                return _beyond(contents[0], contents[1:], rel)

            pooled_here = any(
                pooled.get((kernel, t.name, phase), (0.0, 0.0)) != (0.0, 0.0)
                for t in runs[0].tensors
                for phase in ("before", "after")
            )
            found = difference(
                pair.label,
                runs,
                differs,
                other=1,
                previous=previous,
                noisy=noisy_at is not None or pooled_here,
                position=i + 1,
            )
            if found is not None and found.arguments and noisy_at is not None:
                found = found if found.deltas else None  # arguments that vary between references too
            if found is None:
                continue
            divergent += 1
            if first_divergent is None:
                first_divergent = runs[0].seq
                if divergence is None:
                    divergence, divergent_launches = found, pair.runs[0]
        summaries.append(
            CompareProcesses(
                subject=pair.label,
                references=pair.references,
                compared=pair.n,
                printed=len(pair.runs[0]),
                stop=pair.stop,
                nondeterministic=nondeterministic,
                nondeterministic_in_kernel=in_kernel,
                divergent=divergent,
                first_divergent=first_divergent,
                first_nondeterministic=first_nondeterministic,
            )  # fmt: skip
        )
    return _conclude(
        kind, tuple(summaries), divergence, nondeterminism, notes, reference=tuple(reference),
        reference_env=reference_env, repeat=len(references), limit=limit, subject_launches=divergent_launches,
        read_source=read_source, cwd=cwd,
    )  # fmt: skip


# --- the verdict ---------------------------------------------------------------------------


def _index(device: str | None) -> int | None:
    if device is None:
        return None
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


def _placement(launch: LaunchPrint) -> tuple[list[TensorPrint], list[TensorPrint]]:
    """(tensors on the launch device, tensors elsewhere) of a GPU launch."""
    home = [t for t in launch.tensors if t.device == launch.device]
    away = [t for t in launch.tensors if t.device != launch.device]
    return home, away


def _usual_stream(launches: Sequence[LaunchPrint], device: str | None) -> int | None:
    """The stream most of ``launches`` on ``device`` ran on."""
    counts: dict[int, int] = {}
    for launch in launches:
        if launch.device == device and launch.stream is not None:
            counts[launch.stream] = counts.get(launch.stream, 0) + 1
    return max(counts, key=lambda s: counts[s]) if counts else None


def _stream(handle: int | None) -> str:
    if handle is None:
        return "no stream"
    return "the default stream" if handle in DEFAULT_STREAMS else f"stream 0x{handle:x}"


def _names(deltas: Sequence[TensorDelta]) -> str:
    return ", ".join(d.name for d in deltas)


def _where_lines(d: LaunchDifference, reference: str, verb: str = "diverged") -> list[str]:
    inputs = [x for x in d.deltas if not x.written]
    outputs = [x for x in d.deltas if x.written]
    before = d.previous
    since = (
        f"between the last matched launch (#{before.seq} {_describe(before)}) and this one"
        if before is not None
        else "before this launch, its process's first printed one"
    )
    lines: list[str] = []
    if d.where == "before":
        what = [f"its inputs {_names(inputs)}" if inputs else "", f"its {d.arguments}" if d.arguments else ""]
        lines.append(
            f"{verb} before it: {' and '.join(w for w in what if w)} already differ from {reference}, read "
            f"just before it on its stream: the difference arose {since}, in the torch or NCCL ops in between, "
            "or its inputs were not finished when its stream reached them"
        )
    elif d.where == "in-kernel":
        lines.append(
            f"{verb} in the kernel: every tensor it only reads was equal to {reference} just before it, "
            f"and {_names(outputs)}, which it writes, differ after it"
        )
    else:
        lines.append(
            f"undecided: the tensors it only reads were equal, but {_names(d.written_before)}, which it writes, "
            "held different contents before it, contents the runs reproduce (values it accumulates into, or "
            "a buffer reused from earlier work): if the kernel reads them, the difference is older than this launch"
        )
    if d.where != "undecided" and d.written_before:
        lines.append(
            f"{_names(d.written_before)}, which it writes, also held different contents before it (not counted "
            "as an input)"
        )
    if d.noisy:
        lines.append("this launch also differs between the reference runs: compared within the tolerance")
    return lines


def _cause(
    kind: CompareKind, d: LaunchDifference, subject_launches: Sequence[LaunchPrint]
) -> tuple[str | None, Confidence | None, str]:
    """The cause id the divergent launch's devices and streams point at, and why."""
    launch = d.launch
    if launch.device is None:
        return (
            None,
            None,
            "under the interpreter there is no device or stream to blame: the program itself behaves differently",
        )
    home, away = _placement(launch)
    gpus_away = sorted({t.device for t in away if _index(t.device) is not None})
    if kind is CompareKind.BLOCKING:
        if away:
            return (
                "cross-device-stream-race",
                Confidence.HIGH,
                (
                    f"an ordering fault: launched on {launch.device} with {', '.join(t.name for t in away)} on "
                    f"{', '.join(sorted({t.device for t in away}))}, read over peer access and unordered against that "
                    "device's stream; with every launch blocking it matched"
                ),
            )
        usual = _usual_stream(subject_launches, launch.device)
        if usual is not None and launch.stream != usual:
            return (
                "wrong-device-stream",
                Confidence.HIGH,
                (
                    f"an ordering fault: launched on {_stream(launch.stream)} of {launch.device}, while this process's "
                    f"launches on {launch.device} ran on {_stream(usual)}: its stream does not wait for the producer of "
                    "its inputs; with every launch blocking it matched"
                ),
            )
        return (
            "cross-device-stream-race",
            Confidence.MEDIUM,
            (
                f"an ordering fault: launched on {_stream(launch.stream)} of {launch.device}, the stream of this "
                "process's other launches there, with every tensor on its device: the producer of its inputs ran on "
                "a stream (or a GPU) it does not wait for; with every launch blocking it matched"
            ),
        )
    if kind is CompareKind.COMMAND:
        if away and home:
            return (
                "default-device-buffer",
                Confidence.HIGH,
                (
                    f"a placement fault: {', '.join(t.name for t in away)} on {', '.join(sorted({t.device for t in away}))} "
                    f"beside {', '.join(t.name for t in home)} on the launch device {launch.device}"
                ),
            )
        if away and gpus_away:
            return (
                "missing-device-guard",
                Confidence.HIGH,
                (
                    f"a placement fault: launched on {launch.device} (the current device) with every tensor on "
                    f"{', '.join(gpus_away)}: read remotely, unordered against that device's stream"
                ),
            )
        return (
            None,
            None,
            (
                "a placement-dependent result with every tensor on its launch device: no cause of the catalogue "
                "fits (state cached from another device, memory the kernel reads that it was not passed)"
                if d.where == "in-kernel"
                else "the torch or NCCL ops before it give other values on this placement"
            ),
        )
    return None, None, ""


def launch_wrapper(site: SourceSite | None, read_source: Callable[[str], str | None]) -> str | None:
    """``path.py:function`` when ``site`` is inside a module-level function that takes
    ``fn(x, w, m_sizes)`` (three positional arguments, nothing else required), else None."""
    if site is None:
        return None
    text = read_source(site.file)
    if text is None:
        return None
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name != site.function:
            continue
        if not node.lineno <= site.line <= (node.end_lineno or node.lineno):
            continue
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        required = len(positional) - len(args.defaults)
        takes_three = len(positional) >= 3 or args.vararg is not None
        kw_required = any(d is None for d in args.kw_defaults)
        if takes_three and required <= 3 and not kw_required:
            return f"{site.file}:{node.name}"
    return None


def _shown_path(ref: str, cwd: str | None) -> str:
    path, _, name = ref.rpartition(":")
    if cwd:
        try:
            rel = os.path.relpath(path, cwd)
        except ValueError:
            rel = path
        if not rel.startswith(".."):
            path = rel
    return f"{path}:{name}"


def scan_command(
    cause: str | None, d: LaunchDifference, read_source: Callable[[str], str | None] | None, cwd: str | None
) -> tuple[str, str]:
    """(the scan command that proves ``cause`` on the extracted kernel, or "" and why not)."""
    if cause is None or cause not in SCAN_CONDITIONS:
        return "", ""
    if read_source is None:
        return "", ""
    launch = d.launch
    ref = launch_wrapper(launch.launch_site, read_source) or launch_wrapper(launch.call_site, read_source)
    if ref is None:
        site = launch.launch_site or launch.call_site
        where = f" ({site.file}:{site.line} in {site.function})" if site is not None else ""
        return "", (
            f"the launch{where} is not inside a module-level fn(x, w, m_sizes) function: extract the kernel's "
            "call into one to scan it (qmoe-doctor scan --kernel path/to/file.py:function)"
        )
    gpus, only = SCAN_CONDITIONS[cause]
    home = _index(launch.device) or 0
    away = next((i for t in launch.tensors if (i := _index(t.device)) is not None and i != home), None)
    ids = f"{home}" if gpus == "single" else f"{home},{away if away is not None else (1 if home == 0 else 0)}"
    return f"qmoe-doctor scan --kernel {_shown_path(ref, cwd)} --gpus {ids} --only {only}", ""


def _conclude(
    kind: CompareKind,
    processes: tuple[CompareProcesses, ...],
    divergence: LaunchDifference | None,
    nondeterminism: LaunchDifference | None,
    notes: list[str],
    *,
    reference: tuple[str, ...],
    reference_env: dict[str, str],
    repeat: int,
    limit: int,
    subject_launches: Sequence[LaunchPrint],
    read_source: Callable[[str], str | None] | None,
    cwd: str | None,
) -> RunCompare:
    compared = sum(p.compared for p in processes)
    noisy = sum(p.nondeterministic for p in processes)
    against = {
        CompareKind.BLOCKING: "the CUDA_LAUNCH_BLOCKING=1 run",
        CompareKind.REPEAT: "another run",
        CompareKind.COMMAND: "the reference command",
    }[kind]
    tolerance = (
        "a kernel argument whose prints differ between the reference runs at any launch is nondeterministic: "
        f"at every launch its sum and sum of |x| must lie within {FACTOR:g} x the largest relative spread the "
        f"reference runs showed for it, and at least {NOISE_FLOOR:g} of its sum of |x|, of their range, and its "
        "non-finite count within theirs; every other argument must match exactly (sums, non-finite count, "
        "sampled values)"
        if kind is not CompareKind.REPEAT
        else "every run is the same command: any launch whose prints differ between runs is nondeterministic"
    )
    explanation: list[str] = []
    nondeterministic_lines: tuple[str, ...] = ()
    cause: str | None = None
    confidence: Confidence | None = None
    scan = scan_note = ""
    if nondeterminism is not None:
        n = nondeterminism
        first = n.position == 1 and n.where == "before"
        if first:
            notes.append(
                "the first printed launch already receives different inputs in different runs: the program's "
                "inputs differ run to run (an unseeded random generator?): seed it (torch.manual_seed, "
                "random.seed, numpy) for a sharper compare"
            )
    if kind is not CompareKind.REPEAT and nondeterminism is not None:
        lines = _where_lines(nondeterminism, "the other reference run", verb="differs")
        nondeterministic_lines = tuple(
            line for line in lines if not line.startswith("this launch also differs")
        )
    if divergence is None and compared == 0:
        # no launch was matched between the runs: nothing was checked, so nothing is claimed
        verdict = f"nothing compared: no printed launch of the command could be matched with {against}"
    elif kind is CompareKind.REPEAT:
        if nondeterminism is None:
            verdict = f"deterministic: {compared:,} launches gave equal prints in all {repeat + 1} runs"
        else:
            n = nondeterminism
            verdict = (
                f"nondeterministic from {_describe(n.launch)} in {n.process} ({noisy:,} of {compared:,} compared "
                f"launches differ between runs): not a fault by itself"
            )
            explanation += [
                *_where_lines(n, "the other run", verb="differs"),
                "accumulation order (atomic adds, split-K) gives differences of rounding size from run to run; "
                "a race gives large ones. Run --compare blocking: a launch that stays nondeterministic with every "
                "launch blocking is accumulation order; one that becomes deterministic was a race",
            ]
            explanation = [line for line in explanation if not line.startswith("this launch also differs")]
    elif divergence is None:
        verdict = f"no divergence: {compared:,} launches matched {against}"
        if noisy:
            verdict += f" ({noisy:,} nondeterministic between reference runs, within the tolerance)"
    else:
        d = divergence
        cause, confidence, why = _cause(kind, d, subject_launches)
        verdict = f"{_describe(d.launch)} in {d.process} is the first launch that differs from {against}"
        if why:
            verdict += f": {why.split(':', 1)[0]}"
        explanation += _where_lines(d, against)
        if why:
            explanation.append(why)
        scan, scan_note = scan_command(cause, d, read_source, cwd)
    return RunCompare(
        kind=kind,
        reference=reference,
        reference_env=reference_env,
        repeat=repeat,
        limit=limit,
        processes=processes,
        divergence=divergence,
        nondeterminism=nondeterminism,
        verdict=verdict,
        cause=cause,
        confidence=confidence,
        explanation=tuple(explanation),
        nondeterminism_explanation=nondeterministic_lines,
        scan=scan,
        scan_note=scan_note,
        tolerance=tolerance,
        notes=tuple(notes),
    )


__all__ = [
    "FACTOR",
    "NOISE_FLOOR",
    "PassPrints",
    "ProcessRun",
    "align",
    "compare_prints",
    "difference",
    "launch_wrapper",
    "match_processes",
    "noise",
    "scan_command",
    "tensor_delta",
]
