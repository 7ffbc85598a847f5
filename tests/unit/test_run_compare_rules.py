"""`qmoe-doctor run --compare` on recorded fingerprints: the pure side (``core.fingerprints``,
``diagnose.compare``) and the report's JSON, JUnit and text.

Each case builds the prints a pass would have written (launches of one process, each tensor's
contents before and after) and checks what the comparison concludes: how launches are matched and
where the sequences stop matching, which launches are nondeterministic and how they are compared,
whether a difference arose in the kernel or before it, and the verdict each reference gives from
the divergent launch's devices and streams.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from qmoe_doctor.core.compare import CompareKind, RunCompare
from qmoe_doctor.core.fingerprints import (
    SAMPLE_HASHED,
    SAMPLE_KEPT,
    Contents,
    LaunchPrint,
    PrintsState,
    ProcessPrints,
    TensorPrint,
    kept_indices,
    launch_line,
    read_prints,
    sample_hash,
    sample_positions,
    state_line,
)
from qmoe_doctor.core.launches import SourceSite
from qmoe_doctor.core.records import Confidence, from_jsonable, to_json
from qmoe_doctor.core.reports import RunPass, RunReport
from qmoe_doctor.diagnose.compare import (
    FACTOR,
    NOISE_FLOOR,
    PassPrints,
    ProcessRun,
    align,
    compare_prints,
    launch_wrapper,
    match_processes,
    tensor_delta,
)
from qmoe_doctor.reports.json import json_document
from qmoe_doctor.reports.run_junit import run_junit_text


def contents(values: list[float]) -> Contents:
    """The print of a tensor holding ``values`` (small: every value is sampled)."""
    return Contents.from_vector([sum(values), sum(abs(v) for v in values), 0, *values])


def tensor(name: str, before: list[float], after: list[float] | None = None, device: str = "cpu") -> TensorPrint:
    return TensorPrint(
        name=name, device=device, dtype="float32", shape=(len(before),), numel=len(before),
        before=contents(before), after=contents(after) if after is not None else None,
    )  # fmt: skip


def launch(
    seq: int,
    kernel: str,
    ordinal: int,
    *tensors: TensorPrint,
    device: str | None = None,
    stream: int | None = None,
    config: str | None = "BLOCK=64",
    grid: tuple[int, ...] = (1,),
    site: SourceSite | None = None,
) -> LaunchPrint:
    return LaunchPrint(
        seq=seq, kernel=kernel, ordinal=ordinal, config=config, scalars="N=4", grid=grid, device=device,
        stream=stream, call_site=site, launch_site=site, tensors=tensors,
    )  # fmt: skip


def program(x: list[float], *, bump: float = 0.0, corrupt: float = 0.0, device: str | None = None) -> list[LaunchPrint]:
    """Two steps of y = 2x (``scale``) then z = y + 1 (``shift``): four launches. ``bump`` is added
    inside every shift launch (a fault in the kernel); ``corrupt`` to y's first element between
    the second scale and the second shift (a fault before the launch)."""
    launches = []
    seq = 0
    for step in range(2):
        y = [2 * v for v in x]
        seq += 1
        launches.append(launch(seq, "scale", step + 1, tensor("x_ptr", x), tensor("y_ptr", [0.0] * len(x), y)))
        if step == 1 and corrupt:
            y = [y[0] + corrupt, *y[1:]]
        z = [v + 1 + bump for v in y]
        seq += 1
        launches.append(launch(seq, "shift", step + 1, tensor("x_ptr", y), tensor("y_ptr", [0.0] * len(y), z)))
        x = z
    return launches


def run_of(launches: list[LaunchPrint], label: str = "pid 1", rank: int | None = None) -> PassPrints:
    return PassPrints(processes=(ProcessRun(label=label, rank=rank, prints=ProcessPrints(launches=tuple(launches))),))


X = [0.5, -1.25, 2.0, 3.0]


def compare(kind: CompareKind, subject: PassPrints, *references: PassPrints, **kw: object) -> RunCompare:
    return compare_prints(kind, subject, references, reference=("python", "t.py"), reference_env={}, limit=128, **kw)  # type: ignore[arg-type]


# --- the prints ---------------------------------------------------------------------------------


def test_sample_positions_are_fixed_spread_and_keep_both_ends() -> None:
    assert sample_positions(5) == [0, 1, 2, 3, 4]  # a small tensor: every element
    big = sample_positions(10**9)
    assert len(big) == SAMPLE_HASHED and big[0] == 0 and big[-1] == 10**9 - 1
    assert big == sample_positions(10**9)  # the same in every run and process
    assert all(b > a for a, b in zip(big, big[1:], strict=False))
    assert len(kept_indices(SAMPLE_HASHED)) == SAMPLE_KEPT and kept_indices(3) == [0, 1, 2]


def test_contents_equal_only_when_every_measure_is() -> None:
    a = contents([1.0, 2.0])
    assert a.same(contents([1.0, 2.0]))
    assert not a.same(contents([2.0, 1.0]))  # same sums, other values at the sampled positions
    assert not a.same(contents([1.0, 2.5]))
    nan = Contents.from_vector([math.nan, math.nan, 1, math.nan])
    assert nan.same(Contents.from_vector([math.nan, math.nan, 1, math.nan]))  # NaN sums compare equal
    assert a.sample_hash == sample_hash([1.0, 2.0])


def test_a_prints_file_reads_back_and_counts_a_cut_line() -> None:
    first = launch(2, "k", 1, tensor("x_ptr", [1.0], [2.0]))
    text = (
        state_line(PrintsState(pid=7))
        + launch_line(first)
        + launch_line(launch(1, "k", 1))
        + state_line(PrintsState(pid=7, printed=2, final=True))
        + launch_line(first)[:40]  # a hard end mid-line
    )
    assert json.loads(launch_line(first)) == json.loads('{"launch":' + to_json(first) + "}")  # the generic writer's
    back = read_prints(text)
    assert [p.seq for p in back.launches] == [1, 2]  # in launch order
    assert back.launches[1] == first
    assert back.state is not None and back.state.final and back.state.printed == 2
    assert back.unreadable == 1


# --- matching ----------------------------------------------------------------------------------


def test_launches_match_until_the_sequences_part_and_the_report_says_where() -> None:
    ref = program(X)
    assert align([ref, program(X)], ["the subject", "ref"]) == (4, "")
    # one more scale launch first: its launch 1 matches, then the kernels part
    shifted = [launch(p.seq + 1, p.kernel, p.ordinal + (p.kernel == "scale"), *p.tensors) for p in ref]
    extra = [launch(1, "scale", 1, *ref[0].tensors), *shifted]
    n, stop = align([extra, ref], ["the subject", "reference run 1"])
    assert n == 1
    assert stop == (
        "at launch #2 of the subject (#2 of reference run 1): the subject launched `scale` (its launch 2), "
        "reference run 1 `shift` (its launch 1)"
    )
    tuned = [launch(1, "scale", 1, *ref[0].tensors, config="BLOCK=128"), *ref[1:]]
    n, stop = align([tuned, ref], ["the subject", "reference run 1"])
    assert n == 0 and "BLOCK=128 in the subject and BLOCK=64 in reference run 1" in stop
    assert "another autotune choice" in stop
    n, stop = align([ref[:3], ref], ["the subject", "reference run 1"])
    assert n == 3 and "the subject printed no more, reference run 1 went on with `shift` (its launch 2) (#4)" in stop


def test_runs_that_part_at_the_first_launch_compared_nothing_and_claim_nothing() -> None:
    """No launch matched (another autotune choice at launch 1): not "no divergence", not
    "deterministic": the section says nothing was compared and claims neither health nor fault."""
    ref = program(X)
    tuned = [launch(1, "scale", 1, *ref[0].tensors, config="BLOCK=128"), *ref[1:]]
    for kind in (CompareKind.BLOCKING, CompareKind.REPEAT):
        result = compare(kind, run_of(tuned), run_of(ref))
        assert result.nothing_compared and not result.diverged
        assert result.verdict.startswith("nothing compared: no printed launch"), result.verdict
    matched = compare(CompareKind.BLOCKING, run_of(program(X)), run_of(program(X)))
    assert not matched.nothing_compared and matched.verdict.startswith("no divergence: 4 launches")


def test_processes_match_by_rank_and_a_count_mismatch_is_said() -> None:
    s = PassPrints(
        processes=(
            ProcessRun(label="rank 0 (pid 1)", rank=0, prints=ProcessPrints()),
            ProcessRun(label="rank 1 (pid 2)", rank=1, prints=ProcessPrints()),
        )
    )
    r = PassPrints(processes=(ProcessRun(label="rank 1 (pid 9)", rank=1, prints=ProcessPrints()),))
    pairs, notes = match_processes(s, [r])
    assert [(p.label, [m.label if m else None for m in refs]) for p, refs in pairs] == [
        ("rank 0 (pid 1)", [None]),
        ("rank 1 (pid 2)", ["rank 1 (pid 9)"]),
    ]
    assert "different numbers of processes (subject: 2, reference run 1: 1)" in notes[0] and "by rank" in notes[0]
    result = compare(CompareKind.BLOCKING, s, r)
    assert result.processes[0].stop == "no process of the reference matched it"


# --- where a difference arose ----------------------------------------------------------------


def test_a_difference_before_the_launch_is_placed_between_the_last_match_and_it() -> None:
    result = compare(CompareKind.BLOCKING, run_of(program(X, corrupt=0.25)), run_of(program(X)), run_of(program(X)))
    d = result.divergence
    assert d is not None and (d.launch.kernel, d.launch.ordinal, d.where) == ("shift", 2, "before")
    assert [t.name for t in d.deltas] == ["x_ptr", "y_ptr"]  # its input, and so its output
    assert d.previous is not None and (d.previous.kernel, d.previous.ordinal) == ("scale", 2)
    assert any("between the last matched launch (#3 `scale` (its launch 2)) and this one" in line for line in result.explanation)
    assert result.processes[0].first_divergent == 4 and not result.nondeterminism


def test_a_difference_in_the_kernel_has_equal_inputs_and_different_outputs() -> None:
    result = compare(CompareKind.BLOCKING, run_of(program(X, bump=0.5)), run_of(program(X)), run_of(program(X)))
    d = result.divergence
    assert d is not None and (d.launch.kernel, d.launch.ordinal, d.where) == ("shift", 1, "in-kernel")
    (y,) = d.deltas
    assert y.name == "y_ptr" and y.written and y.phase == "after"
    assert y.sum_delta == pytest.approx(0.5 * len(X)) and y.sample_max_abs == pytest.approx(0.5)
    assert y.mean_abs_lower_bound == pytest.approx(0.5)  # |d sum| / numel: every element moved by 0.5
    assert d.previous is not None and d.previous.kernel == "scale"


def test_a_written_tensor_held_other_reproducible_contents_before_it_is_undecided() -> None:
    ref = program(X)
    out = ref[1].tensors[1]
    stale = TensorPrint(**{**{f: getattr(out, f) for f in ("name", "device", "dtype", "shape", "numel", "after")}, "before": contents([9.0] * 4)})
    subject = [ref[0], launch(2, "shift", 1, ref[1].tensors[0], stale), *ref[2:]]
    result = compare(CompareKind.BLOCKING, run_of(subject), run_of(ref), run_of(ref))
    assert result.divergence is None  # what it wrote is the same: nothing diverged
    bumped = program(X, bump=0.5)
    subject = [bumped[0], launch(2, "shift", 1, bumped[1].tensors[0], TensorPrint(**{**{f: getattr(bumped[1].tensors[1], f) for f in ("name", "device", "dtype", "shape", "numel", "after")}, "before": contents([9.0] * 4)})), *bumped[2:]]
    d = compare(CompareKind.BLOCKING, run_of(subject), run_of(ref), run_of(ref)).divergence
    assert d is not None and d.where == "undecided" and [t.name for t in d.written_before] == ["y_ptr"]


def test_uninitialized_contents_that_differ_between_references_are_not_evidence() -> None:
    """torch.empty memory differs from process to process: a written tensor's contents before its
    launch count only when two runs reproduce them."""

    def garbage(launches: list[LaunchPrint], fill: float) -> list[LaunchPrint]:
        out = []
        for p in launches:
            x, y = p.tensors
            y = TensorPrint(name=y.name, device=y.device, dtype=y.dtype, shape=y.shape, numel=y.numel, before=contents([fill] * 4), after=y.after)
            out.append(launch(p.seq, p.kernel, p.ordinal, x, y))
        return out

    result = compare(
        CompareKind.BLOCKING, run_of(garbage(program(X, bump=0.5), 7.0)), run_of(garbage(program(X), 8.0)), run_of(garbage(program(X), 9.0))
    )
    d = result.divergence
    assert d is not None and d.where == "in-kernel" and not d.written_before


def test_a_different_grid_is_an_input_difference() -> None:
    ref = program(X)
    subject = [ref[0], launch(2, "shift", 1, *ref[1].tensors, grid=(2,)), *ref[2:]]
    d = compare(CompareKind.BLOCKING, run_of(subject), run_of(ref), run_of(ref)).divergence
    assert d is not None and d.where == "before" and d.arguments == "grid (2,) vs (1,)"


# --- noise -----------------------------------------------------------------------------------------


def noisy(eps: list[float]) -> list[LaunchPrint]:
    """The program with ``eps[i]`` added inside shift launch i (like an atomic add's order: a
    rounding-size difference from run to run)."""
    out = []
    for p in program(X):
        if p.kernel == "shift":
            x = p.tensors[0]
            z = [v + 1 + eps[p.ordinal - 1] for v in x.before.sample]
            p = launch(p.seq, p.kernel, p.ordinal, x, tensor("y_ptr", [0.0] * 4, z))
        out.append(p)
    return out


def test_nondeterministic_launches_are_marked_and_compared_within_the_references_spread() -> None:
    refs = (run_of(noisy([1e-6, 2e-6])), run_of(noisy([3e-6, 1e-6])))
    quiet = compare(CompareKind.BLOCKING, run_of(noisy([2e-6, 2e-6])), *refs)
    assert quiet.divergence is None
    assert quiet.processes[0].nondeterministic == 2 and quiet.nondeterminism is not None
    assert quiet.nondeterminism.where == "in-kernel" and quiet.nondeterminism.launch.kernel == "shift"
    assert "within the tolerance" in quiet.verdict and f"{FACTOR:g} x the largest relative spread" in quiet.tolerance
    loud = compare(CompareKind.BLOCKING, run_of(noisy([2e-6, 0.5])), *refs)
    d = loud.divergence
    assert d is not None and (d.launch.kernel, d.launch.ordinal) == ("shift", 2) and d.noisy
    assert d.deltas[0].tolerance is not None and d.deltas[0].tolerance < 0.5


def test_a_spread_two_runs_underestimate_is_floored_at_a_fraction_of_the_sum_of_abs() -> None:
    refs = (run_of(noisy([1e-9, 1e-9])), run_of(noisy([1.1e-9, 1e-9])))  # a spread of 1e-10 per element
    scale = sum(abs(v) for v in refs[0].processes[0].prints.launches[1].tensors[1].final.sample)
    below = NOISE_FLOOR * scale / len(X) / 2  # per element: half the floor in the sum
    assert compare(CompareKind.BLOCKING, run_of(noisy([below, 1e-9])), *refs).divergence is None
    above = NOISE_FLOOR * scale / len(X) * 2
    d = compare(CompareKind.BLOCKING, run_of(noisy([above, 1e-9])), *refs).divergence
    assert d is not None and d.launch.ordinal == 1


def test_a_kernel_nondeterministic_at_one_launch_is_compared_within_tolerance_at_all() -> None:
    """Two reference runs that happen to agree at one launch of a noisy kernel say little: the
    subject's rounding-size difference there is no divergence."""
    refs = (run_of(noisy([1e-6, 2e-6])), run_of(noisy([3e-6, 2e-6])))  # equal at shift launch 2
    result = compare(CompareKind.BLOCKING, run_of(noisy([2e-6, 2.5e-6])), *refs)
    assert result.divergence is None


def test_repeat_names_the_first_nondeterministic_launch_and_finds_no_fault() -> None:
    result = compare(CompareKind.REPEAT, run_of(noisy([1e-6, 1e-6])), run_of(noisy([2e-6, 1e-6])))
    assert result.divergence is None and result.cause is None
    n = result.nondeterminism
    assert n is not None and (n.launch.kernel, n.launch.ordinal, n.where) == ("shift", 1, "in-kernel")
    assert result.verdict.startswith("nondeterministic from `shift` (its launch 1)") and "not a fault" in result.verdict
    assert any("--compare blocking" in line for line in result.explanation)
    assert result.processes[0].nondeterministic == 1 and result.processes[0].nondeterministic_in_kernel == 1
    same = compare(CompareKind.REPEAT, run_of(program(X)), run_of(program(X)))
    assert same.verdict == "deterministic: 4 launches gave equal prints in all 2 runs" and same.nondeterminism is None


def test_an_unseeded_program_is_said_when_its_first_launch_already_differs() -> None:
    result = compare(CompareKind.REPEAT, run_of(program(X)), run_of(program([0.25, *X[1:]])))
    n = result.nondeterminism
    assert n is not None and n.position == 1 and n.where == "before"
    assert any("unseeded random generator" in note for note in result.notes)


# --- verdicts ------------------------------------------------------------------------------------


def gpu_program(*, launch_device: str, stream: int, devices: tuple[str, str], bad: bool, others_stream: int = 0) -> list[LaunchPrint]:
    """scale then shift on a GPU; the shift launch on ``launch_device``/``stream`` with its
    tensors on ``devices``; ``bad``: its output off by 0.5."""
    y = [2 * v for v in X]
    z = [v + 1 + (0.5 if bad else 0.0) for v in y]
    return [
        launch(1, "scale", 1, tensor("x_ptr", X, device=devices[0]), tensor("y_ptr", [0.0] * 4, y, device=devices[0]), device=devices[0], stream=others_stream),
        launch(2, "shift", 1, tensor("x_ptr", y, device=devices[0]), tensor("y_ptr", [0.0] * 4, z, device=devices[1]), device=launch_device, stream=stream),
        launch(3, "scale", 2, tensor("x_ptr", z, device=devices[0]), tensor("y_ptr", [0.0] * 4, [2 * v for v in z], device=devices[0]), device=devices[0], stream=others_stream),
    ]


@pytest.mark.parametrize(
    ("kind", "launch_device", "stream", "devices", "cause", "confidence"),
    [
        (CompareKind.BLOCKING, "cuda:0", 0, ("cuda:1", "cuda:1"), "cross-device-stream-race", Confidence.HIGH),
        (CompareKind.BLOCKING, "cuda:0", 0xA0, ("cuda:0", "cuda:0"), "wrong-device-stream", Confidence.HIGH),
        (CompareKind.BLOCKING, "cuda:0", 0, ("cuda:0", "cuda:0"), "cross-device-stream-race", Confidence.MEDIUM),
        (CompareKind.COMMAND, "cuda:0", 0, ("cuda:1", "cuda:1"), "missing-device-guard", Confidence.HIGH),
        (CompareKind.COMMAND, "cuda:0", 0, ("cuda:1", "cuda:0"), "default-device-buffer", Confidence.HIGH),
        (CompareKind.COMMAND, "cuda:0", 0, ("cuda:0", "cuda:0"), None, None),
    ],
)
def test_each_reference_names_the_cause_its_divergent_launch_shows(
    kind: CompareKind, launch_device: str, stream: int, devices: tuple[str, str], cause: str | None, confidence: Confidence | None
) -> None:
    subject = gpu_program(launch_device=launch_device, stream=stream, devices=devices, bad=True)
    reference = gpu_program(launch_device="cuda:0", stream=0, devices=("cuda:0", "cuda:0"), bad=False)
    result = compare(kind, run_of(subject), run_of(reference), run_of(reference))
    assert result.divergence is not None and result.divergence.launch.kernel == "shift"
    assert (result.cause, result.confidence) == (cause, confidence)
    if cause == "wrong-device-stream":
        assert "stream 0xa0 of cuda:0" in result.explanation[-1] and "ran on the default stream" in result.explanation[-1]
    if cause is None:
        assert "no cause of the catalogue fits" in result.explanation[-1]


def test_repeat_and_the_interpreter_name_no_cause() -> None:
    result = compare(CompareKind.BLOCKING, run_of(program(X, bump=0.5)), run_of(program(X)))
    assert result.divergence is not None and result.cause is None
    assert "under the interpreter there is no device or stream to blame" in result.verdict


def test_the_scan_command_is_given_for_a_fn_x_w_m_sizes_wrapper_only(tmp_path: Path) -> None:
    source = tmp_path / "moe.py"
    source.write_text(
        "def grouped_gemm(x, w, m_sizes, *, out=None):\n    kernel[(1,)](x, w, m_sizes)\n\n\n"
        "class Block:\n    def forward(self, x, w, m_sizes):\n        kernel[(1,)](x, w, m_sizes)\n\n\n"
        "def two(x, w):\n    kernel[(1,)](x, w)\n"
    )
    read = lambda path: Path(path).read_text()  # noqa: E731
    assert launch_wrapper(SourceSite(file=str(source), line=2, function="grouped_gemm"), read) == f"{source}:grouped_gemm"
    assert launch_wrapper(SourceSite(file=str(source), line=7, function="forward"), read) is None  # a method
    assert launch_wrapper(SourceSite(file=str(source), line=11, function="two"), read) is None  # two arguments
    site = SourceSite(file=str(source), line=2, function="grouped_gemm")
    subject = gpu_program(launch_device="cuda:0", stream=0xA0, devices=("cuda:0", "cuda:0"), bad=True)
    subject[1] = LaunchPrint(**{**{f: getattr(subject[1], f) for f in LaunchPrint.__dataclass_fields__}, "launch_site": site})
    reference = gpu_program(launch_device="cuda:0", stream=0, devices=("cuda:0", "cuda:0"), bad=False)
    result = compare(CompareKind.BLOCKING, run_of(subject), run_of(reference), read_source=read, cwd=str(tmp_path))
    assert result.scan == "qmoe-doctor scan --kernel moe.py:grouped_gemm --gpus 0 --only single,side-stream"
    unshaped = gpu_program(launch_device="cuda:0", stream=0xA0, devices=("cuda:0", "cuda:0"), bad=True)
    result = compare(CompareKind.BLOCKING, run_of(unshaped), run_of(reference), read_source=read, cwd=str(tmp_path))
    assert not result.scan and "not inside a module-level fn(x, w, m_sizes) function" in result.scan_note


def test_measures_are_what_the_prints_hold() -> None:
    a = tensor("y_ptr", [0.0] * 4, [1.0, 2.0, 3.0, 4.0])
    b = tensor("y_ptr", [0.0] * 4, [1.0, 2.0, 3.0, 6.0])
    d = tensor_delta(a, b, "after", written=True)
    assert d.sum_delta == -2.0 and d.abs_sum_delta == -2.0 and d.hash_differs
    assert (d.sample_max_abs, d.sample_mean_abs, d.sample_differing, d.sample_kept) == (2.0, 0.5, 1, 4)
    assert d.sample_max_rel == pytest.approx(2 / 6) and d.mean_abs_lower_bound == 0.5


# --- the report ------------------------------------------------------------------------------


def report_with(result: RunCompare) -> RunReport:
    first = RunPass(label="run", argv=("python", "t.py"), exit_code=0, end="exited with status 0", wall_s=1.0)
    ref = RunPass(label="reference", argv=("python", "t.py"), env={"CUDA_LAUNCH_BLOCKING": "1"}, exit_code=0, end="exited with status 0", wall_s=1.5)
    return RunReport(
        command=("python", "t.py"), started="2026-12-07T00:00:00+00:00", wall_s=3.0, exit_code=0, command_exit=0,
        passes=(first,), compare=result, reference_passes=(ref,),
    )  # fmt: skip


def test_the_compare_section_is_in_the_json_junit_and_text_reports() -> None:
    subject = gpu_program(launch_device="cuda:0", stream=0xA0, devices=("cuda:0", "cuda:0"), bad=True)
    reference = gpu_program(launch_device="cuda:0", stream=0, devices=("cuda:0", "cuda:0"), bad=False)
    report = report_with(compare(CompareKind.BLOCKING, run_of(subject), run_of(reference)))
    assert not report.healthy
    doc = json.loads(json.dumps(json_document("run", report)))
    assert doc["kind"] == "run" and doc["compare"]["kind"] == "blocking" and doc["compare"]["cause"] == "wrong-device-stream"
    back = from_jsonable(RunReport, doc)
    assert back.compare == report.compare and back.reference_passes == report.reference_passes
    old = {k: v for k, v in doc.items() if k not in ("compare", "reference_passes")}  # a report from before compare
    assert from_jsonable(RunReport, old).compare is None
    failures = ET.fromstring(run_junit_text(report)).findall(".//failure")
    assert [f.get("type") for f in failures] == ["wrong-device-stream"]
    from rich.console import Console

    from qmoe_doctor.cli.render.run import render_run

    console = Console(record=True, width=200)
    render_run(console, report)
    text = console.export_text()
    assert "first divergent launch: #2 shift (launch 1 of it) grid (1,) on cuda:0 stream 0xa0 in pid 1" in text
    assert "y_ptr (after the launch): sum 14.5 vs 12.5 (difference 2," in text and "last matched launch: #1 scale" in text
    assert "cause: wrong-device-stream (high confidence)" in text and "1 divergent launch" in text
    clean = report_with(compare(CompareKind.BLOCKING, run_of(reference), run_of(reference)))
    assert clean.healthy and not ET.fromstring(run_junit_text(clean)).findall(".//failure")
