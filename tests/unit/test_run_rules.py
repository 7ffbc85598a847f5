"""The device checks of `qmoe-doctor run` as pure functions over synthetic launch facts
(``diagnose.launch_rules``), and what the run concludes from process records
(``diagnose.run_findings``): one case per finding, each with the near miss that must stay silent."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.launches import (
    INT32_LIMIT,
    EndKind,
    FindingKind,
    KernelSeen,
    Launch,
    LaunchFacts,
    ProcessEnd,
    ProcessRecord,
    SourceSite,
    TensorArg,
    element_span,
)
from qmoe_doctor.core.lint_findings import LintFinding, Rule
from qmoe_doctor.core.records import ErrorKind, from_json, to_json
from qmoe_doctor.diagnose import launch_rules, run_findings, stream_rules


def tensor(name: str, device: str, shape: tuple[int, ...] = (4, 8), *, ptr: int = 0x1000, dtype: str = "bfloat16") -> TensorArg:
    strides = tuple(int(s) for s in _contiguous(shape))
    numel = 1
    for d in shape:
        numel *= d
    return TensorArg(
        name=name, device=device, data_ptr=ptr, nbytes=numel * 2, shape=shape, strides=strides, dtype=dtype, numel=numel
    )


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= d
    return list(reversed(out))


INT32_NOTE = LintFinding(
    path="k.py", line=106, col=20, rule=Rule.INT32_OFFSET, cause="int32-offset-overflow",
    message="`expert * stride_we` is formed in int32", fix="expert.to(tl.int64) * stride_we",
)


def facts(
    device: str | None, *tensors: TensorArg, lint: tuple[LintFinding, ...] = (), rank: int | None = None
) -> LaunchFacts:
    return LaunchFacts(seq=7, kernel="_k", device=device, tensors=tensors, int32_lint=lint, local_rank=rank)


def operands(gpu: int, *, y: int | None = None) -> tuple[TensorArg, ...]:
    """A grouped GEMM's x, w, m_sizes on cuda:gpu and its output y on cuda:y (default: gpu)."""
    return (
        tensor("x_ptr", f"cuda:{gpu}"),
        tensor("w_ptr", f"cuda:{gpu}", (8, 4, 8)),
        tensor("m_sizes_ptr", f"cuda:{gpu}", (8,), dtype="int32"),
        tensor("y_ptr", f"cuda:{gpu if y is None else y}"),
    )


# --- one row per edge: (what it covers, facts, peer access, kinds expected) ---
CASES = [
    ("all on the launch device", facts("cuda:0", tensor("x", "cuda:0"), tensor("w", "cuda:0")), None, []),
    (
        "every tensor on another GPU: the missing guard",
        facts("cuda:0", tensor("x", "cuda:1"), tensor("w", "cuda:1")),
        True,
        [FindingKind.OTHER_DEVICE],
    ),
    (
        "a buffer on the current device, inputs elsewhere: both the guard and the mix",
        facts("cuda:0", tensor("x", "cuda:1"), tensor("y", "cuda:0")),
        False,
        [FindingKind.OTHER_DEVICE, FindingKind.MIXED_DEVICES],
    ),
    (
        "two GPUs, neither the launch's: one finding per other GPU, and the mix",
        facts("cuda:0", tensor("x", "cuda:1"), tensor("w", "cuda:2")),
        None,
        [FindingKind.OTHER_DEVICE, FindingKind.OTHER_DEVICE, FindingKind.MIXED_DEVICES],
    ),
    ("a CPU tensor in a GPU launch", facts("cuda:0", tensor("x", "cuda:0"), tensor("m_sizes", "cpu")), None, [FindingKind.CPU_TENSOR]),
    ("the interpreter: CPU tensors are its own", facts(None, tensor("x", "cpu"), tensor("w", "cpu")), None, []),
    (
        "the interpreter with tensors of two GPUs: mixed",
        facts(None, tensor("x", "cuda:0"), tensor("w", "cuda:1")),
        None,
        [FindingKind.MIXED_DEVICES],
    ),
    (
        "a stack past 2**31 elements and an int32 product in the kernel",
        facts("cuda:0", tensor("w", "cuda:0", (160, 5120, 6144)), lint=(INT32_NOTE,)),
        None,
        [FindingKind.INT32_BY_SIZE],
    ),
    (
        "the same stack, a kernel whose lint found no int32 product",
        facts("cuda:0", tensor("w", "cuda:0", (160, 5120, 6144))),
        None,
        [],
    ),
    (
        "an int32 product, every tensor under 2**31 elements",
        facts("cuda:0", tensor("w", "cuda:0", (128, 1536, 2048)), lint=(INT32_NOTE,)),
        None,
        [],
    ),
    (
        "rank 1, guarded launch on its GPU, output made with device='cuda' on cuda:0: one cause, not the guard and the mix",
        facts("cuda:1", *operands(1, y=0), rank=1),
        False,
        [FindingKind.RANK_ON_DEVICE_0],
    ),
    (
        "rank 1, unguarded: launched on cuda:0 with every tensor on cuda:1",
        facts("cuda:0", *operands(1), rank=1),
        None,
        [FindingKind.RANK_ON_DEVICE_0],
    ),
    (
        "rank 3, unguarded and the output on cuda:0 too",
        facts("cuda:0", *operands(3, y=0), rank=3),
        True,
        [FindingKind.RANK_ON_DEVICE_0],
    ),
    (
        "local rank 0: cuda:0 is its own GPU, the guard and the mix as before",
        facts("cuda:0", *operands(1, y=0), rank=0),
        None,
        [FindingKind.OTHER_DEVICE, FindingKind.MIXED_DEVICES],
    ),
    (
        "no LOCAL_RANK (no launcher), guarded launch with its operands, the output on cuda:0: the buffer only",
        facts("cuda:1", *operands(1, y=0)),
        None,
        [FindingKind.MIXED_DEVICES],
    ),
    (
        "the output on the launch device, every operand elsewhere: the guard and the buffer",
        facts("cuda:0", *operands(1, y=0)),
        True,
        [FindingKind.OTHER_DEVICE, FindingKind.MIXED_DEVICES],
    ),
    (
        "an unguarded launch on the current device, its operands on another GPU and several small buffers made here: both",
        facts(
            "cuda:0",
            tensor("x", "cuda:1", (64, 64)),
            tensor("w", "cuda:1", (8, 64, 64)),
            tensor("offsets", "cuda:0", (8,), dtype="int32"),
            tensor("expert_ids", "cuda:0", (8,), dtype="int32"),
            tensor("counts", "cuda:0", (8,), dtype="int32"),
        ),
        None,
        [FindingKind.OTHER_DEVICE, FindingKind.MIXED_DEVICES],
    ),
    (
        "as many tensor bytes on the launch device as on another GPU: both, neither side is the stray one",
        facts("cuda:0", tensor("x", "cuda:0"), tensor("w", "cuda:1")),
        None,
        [FindingKind.OTHER_DEVICE, FindingKind.MIXED_DEVICES],
    ),
    ("rank 1, every tensor on cuda:1 and a guard: nothing", facts("cuda:1", *operands(1), rank=1), None, []),
    (
        "rank 1 with a tensor on a third GPU: not its own GPU against cuda:0; the stray buffer",
        facts("cuda:1", *operands(1, y=2), rank=1),
        None,
        [FindingKind.MIXED_DEVICES],
    ),
    (
        "rank 1 with its tensors mostly on cuda:0: not that rank's tensors with a stray one; the mix",
        facts("cuda:0", tensor("x", "cuda:1"), tensor("w", "cuda:0"), tensor("y", "cuda:0"), rank=1),
        None,
        [FindingKind.MIXED_DEVICES],
    ),
    (
        "rank 1, a CPU tensor beside the stray output: both facts",
        facts("cuda:1", *operands(1, y=0), tensor("bias", "cpu"), rank=1),
        None,
        [FindingKind.RANK_ON_DEVICE_0, FindingKind.CPU_TENSOR],
    ),
    ("rank 1 under the interpreter: no launch device, nothing", facts(None, *operands(1), rank=1), None, []),
]


@pytest.mark.parametrize(("edge", "launch", "peer", "kinds"), CASES, ids=[c[0] for c in CASES])
def test_each_check_fires_on_its_fact_and_only_there(
    edge: str, launch: LaunchFacts, peer: bool | None, kinds: list[FindingKind]
) -> None:
    found = launch_rules.check_launch(launch, (lambda a, b: peer) if peer is not None else None)
    assert sorted(f.kind for f in found) == sorted(kinds), edge
    for f in found:
        assert f.cause in CAUSES, f.cause
        assert f.first_seq == 7 and f.kernel == "_k"
        assert "_k" in f.message


def test_peer_access_says_whether_the_launch_fails_or_runs_remotely() -> None:
    launch = facts("cuda:0", tensor("x", "cuda:1"))
    (remote,) = launch_rules.other_device(launch, lambda a, b: True)
    (fails,) = launch_rules.other_device(launch, lambda a, b: False)
    (unknown,) = launch_rules.other_device(launch)
    assert remote.peer_access is True and "runs remotely" in remote.message
    assert fails.peer_access is False and "the launch fails" in fails.message
    assert unknown.peer_access is None
    assert remote.cause == "missing-device-guard" and [t.name for t in remote.tensors] == ["x"]
    asked: list[tuple[int, int]] = []
    launch_rules.other_device(launch, lambda a, b: asked.append((a, b)) or True)
    assert asked == [(0, 1)]


def test_the_int32_finding_names_the_tensor_its_span_and_the_lint_line() -> None:
    big = tensor("w_ptr", "cuda:0", (160, 5120, 6144))
    (f,) = launch_rules.int32_by_size(facts("cuda:0", big, tensor("x_ptr", "cuda:0"), lint=(INT32_NOTE,)))
    assert f.cause == "int32-offset-overflow" and [t.name for t in f.tensors] == ["w_ptr"]
    assert f"{160 * 5120 * 6144:,}" in f.message and "line 106" in f.message
    assert f.lint == (INT32_NOTE,)


def test_a_view_is_judged_by_the_elements_it_spans_not_its_numel() -> None:
    # a column of a wide matrix: 2 elements, but offsets reach past 2**31
    column = TensorArg(
        name="col", device="cuda:0", data_ptr=0, nbytes=0, shape=(2,), strides=(INT32_LIMIT,), dtype="float16", numel=2
    )
    assert column.span == INT32_LIMIT + 1
    assert element_span((2, 0), (1, 1)) == 0
    (f,) = launch_rules.int32_by_size(facts("cuda:0", column, lint=(INT32_NOTE,)))
    assert f.kind is FindingKind.INT32_BY_SIZE


def test_a_rank_that_never_set_its_device_is_named_with_its_rank_and_the_fix() -> None:
    asked: list[tuple[int, int]] = []
    (f,) = launch_rules.check_launch(
        facts("cuda:1", *operands(1, y=0), rank=1), lambda a, b: asked.append((a, b)) or False
    )
    assert f.cause == "device-never-set" and f.kind is FindingKind.RANK_ON_DEVICE_0
    assert [t.name for t in f.tensors] == ["x_ptr", "w_ptr", "m_sizes_ptr", "y_ptr"]
    assert "LOCAL_RANK=1" in f.message and "torch.cuda.set_device(1)" in f.message
    assert "x_ptr, w_ptr, m_sizes_ptr on cuda:1" in f.message and "y_ptr on cuda:0" in f.message
    assert "device='cuda'" in f.message and "unguarded" not in f.message
    assert asked == [(1, 0)] and f.peer_access is False and "the launch fails" in f.message
    (unguarded,) = launch_rules.device_never_set(facts("cuda:0", *operands(1), rank=1), lambda a, b: True)
    assert "an unguarded launch" in unguarded.message and "runs remotely" in unguarded.message
    assert launch_rules.cross_device(f)  # --strict stops it before it runs
    assert 'torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))' in CAUSES["device-never-set"].fix
    (d,) = run_findings.diagnoses([record(21, rank=1, findings=(f,))])
    assert d.cause == "device-never-set" and d.confidence.value == "high"


def test_strict_stops_cross_device_launches_only() -> None:
    found = launch_rules.check_launch(
        facts("cuda:0", tensor("y", "cuda:0"), tensor("w", "cuda:1", (160, 5120, 6144)), lint=(INT32_NOTE,))
    )
    stops = {f.kind: launch_rules.cross_device(f) for f in found}
    assert stops[FindingKind.OTHER_DEVICE] and stops[FindingKind.MIXED_DEVICES]
    assert not stops[FindingKind.INT32_BY_SIZE]


# --- what the run concludes from the records ---


def launch(seq: int, kernel: str, *, raised: str = "", kernel_seq: int = 1) -> Launch:
    return Launch(seq=seq, kernel=kernel, kernel_seq=kernel_seq, device="cuda:0", raised=raised)


def record(pid: int, *, rank: int | None = None, ring: tuple[Launch, ...] = (), end: ProcessEnd | None = None,
           cuda_error: str = "", findings: tuple = ()) -> ProcessRecord:  # type: ignore[type-arg]
    return ProcessRecord(
        pid=pid, ppid=1, rank=rank, ring=ring, end=end, cuda_error=cuda_error, findings=findings,
        kernels=tuple(KernelSeen(name=k, file="k.py", line=1, launches=1) for k in {x.kernel for x in ring}),
        launches=len(ring),
    )


ILLEGAL = "AcceleratorError: CUDA error: an illegal memory access was encountered"


def test_one_diagnosis_per_kind_and_kernel_across_ranks() -> None:
    (f0,) = launch_rules.other_device(facts("cuda:0", tensor("x", "cuda:1")))
    (f1,) = launch_rules.other_device(facts("cuda:1", tensor("x", "cuda:0")))
    records = [record(11, rank=1, findings=(f1,)), record(10, rank=0, findings=(f0,))]
    (d,) = run_findings.diagnoses(records)
    assert d.cause == "missing-device-guard" and d.processes == ("rank 0 (pid 10)", "rank 1 (pid 11)")
    assert d.finding is f0 and d.launches == 2 and "2 processes" in d.summary


def test_a_cuda_error_keeps_the_launches_before_it_and_blocking_names_the_kernel() -> None:
    ring = tuple(launch(i, "_a" if i % 2 else "_b", kernel_seq=i) for i in range(1, 20))
    ended = ProcessEnd(kind=EndKind.CUDA_ERROR, detail=ILLEGAL, error_kind=ErrorKind.ILLEGAL_ADDRESS)
    (guess,) = run_findings.cuda_errors([record(5, ring=ring, end=ended)], blocking=False)
    assert not guess.exact and guess.faulting is None
    assert [x.seq for x in guess.last_launches] == list(range(12, 20))
    assert "--blocking" in guess.note and "`_a`" in guess.note and "`_b`" in guess.note

    raised = (*ring[:5], launch(6, "_bad", raised="RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered"))
    (exact,) = run_findings.cuda_errors([record(5, ring=raised, cuda_error=raised[-1].raised)], blocking=True)
    assert exact.exact and exact.faulting == "_bad" and exact.last_launches[-1].seq == 6
    (no_launch,) = run_findings.cuda_errors([record(5, ring=ring, end=ended)], blocking=True)
    assert not no_launch.exact and "another kernel" in no_launch.note
    assert run_findings.cuda_errors([record(6, ring=ring, end=ProcessEnd(kind=EndKind.EXIT))], blocking=False) == ()


def test_a_process_without_its_final_record_is_named() -> None:
    (note,) = run_findings.unflushed([record(7, rank=1, ring=(launch(1, "_a"),)), record(8, end=ProcessEnd(kind=EndKind.EXIT))])
    assert "rank 1 (pid 7)" in note and "final record" in note


def test_the_sanitizer_aims_at_the_faulting_kernel_first() -> None:
    ring = tuple(launch(i, "_a" if i % 2 else "_b", kernel_seq=(i + 1) // 2) for i in range(1, 9))
    guess = run_findings.cuda_errors([record(5, ring=ring, cuda_error=ILLEGAL)], blocking=False)
    targets = run_findings.sanitizer_targets(guess, [], [])
    assert targets is not None and set(targets.kernels) == {"_a", "_b"} and targets.launch_count >= 8
    exact = (*ring, launch(9, "_c", raised="RuntimeError: an illegal memory access", kernel_seq=3))
    found = run_findings.cuda_errors([record(5, ring=exact, cuda_error=ILLEGAL)], blocking=True)
    targets = run_findings.sanitizer_targets(found, [], [])
    assert targets is not None and targets.kernels == ("_c",) and targets.launch_count == 4
    assert run_findings.sanitizer_targets([], [], [record(1)]) is None
    seen = run_findings.sanitizer_targets([], [], [record(1, ring=ring)])
    assert seen is not None and set(seen.kernels) == {"_a", "_b"}


def test_tensor_tables_name_each_tensor_after_its_launch() -> None:
    x = tensor("x_ptr", "cuda:0", ptr=0x7000)
    tables = run_findings.tensor_tables([record(1, ring=(Launch(seq=3, kernel="_k", kernel_seq=2, tensors=(x,)),))])
    (info,) = tables["cuda:0"]
    assert info.name == "x_ptr of _k #2" and info.data_ptr == 0x7000 and info.nbytes == x.nbytes


def test_a_process_record_round_trips_through_json() -> None:
    (f,) = launch_rules.other_device(facts("cuda:0", tensor("x", "cuda:1")), lambda a, b: True)
    r = record(9, rank=0, ring=(launch(1, "_k"),), findings=(f,), end=ProcessEnd(kind=EndKind.SIGNAL, detail="SIGTERM"))
    back = from_json(ProcessRecord, to_json(r))
    assert back == r and isinstance(back.findings[0].tensors[0], TensorArg)


# --- the ring check: a kernel on the default stream among its thread's side-stream launches ---

SIDE, SIDE_2 = 0x55D0C3A0, 0x55D0C4F0  # two side streams' cudaStream_t


def at(seq: int, kernel: str, stream: int | None, *, device: str | None = "cuda:0", thread: str = "") -> Launch:
    return Launch(
        seq=seq, kernel=kernel, kernel_seq=seq, device=device, stream=stream, thread=thread,
        tensors=(tensor("x_ptr", device or "cpu"),),
    )


def ring(*launches: tuple[Any, ...]) -> tuple[Launch, ...]:
    """Launches numbered from 1: (kernel, stream) or (kernel, stream, {"device": ..., "thread": ...})."""
    return tuple(
        at(i, kernel, stream, **(where[0] if where else {})) for i, (kernel, stream, *where) in enumerate(launches, 1)
    )


#: The MoE block's forward twice, as the wrong_stream specimen runs it under a side stream: the
#: combine's segment sum on the caller's side stream, the two grouped GEMMs on the default stream.
SPECIMEN = ring(*[("_seg", SIDE), ("_gemm", 0), ("_gemm", 0), ("_seg", SIDE)] * 2)

STREAM_CASES = [
    ("the specimen: the grouped GEMM on the default stream among the side stream's launches", SPECIMEN, ["_gemm"]),
    ("every launch on the default stream: a program that uses no stream", ring(*[("_seg", 0), ("_gemm", 0)] * 3), []),
    ("every launch on one side stream", ring(*[("_seg", SIDE), ("_gemm", SIDE)] * 3), []),
    ("two side streams, none on the default stream", ring(*[("_seg", SIDE), ("_gemm", SIDE_2)] * 3), []),
    (
        "the per-thread default stream (2) is a default stream too",
        ring(("_seg", SIDE), ("_gemm", 2), ("_seg", SIDE)),
        ["_gemm"],
    ),
    (
        "a phase on the default stream before the side stream's: never between two side launches",
        ring(("_gemm", 0), ("_gemm", 0), ("_seg", SIDE), ("_seg", SIDE)),
        [],
    ),
    (
        "the kernel once on the side stream too: it follows the caller's stream",
        ring(("_seg", SIDE), ("_gemm", 0), ("_gemm", SIDE), ("_seg", SIDE)),
        [],
    ),
    (
        "the side stream's launches in another thread: each thread has its own current stream",
        ring(("_seg", SIDE, {"thread": "worker"}), ("_gemm", 0), ("_seg", SIDE, {"thread": "worker"})),
        [],
    ),
    (
        "the side stream's launches on another device",
        ring(("_seg", SIDE, {"device": "cuda:1"}), ("_gemm", 0), ("_seg", SIDE, {"device": "cuda:1"})),
        [],
    ),
    (
        "the interpreter: no stream recorded",
        ring(*[("_seg", None, {"device": None}), ("_gemm", None, {"device": None})] * 2),
        [],
    ),
]


@pytest.mark.parametrize(("edge", "launches", "kernels"), STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
def test_the_default_stream_check_fires_on_its_pattern_only(
    edge: str, launches: tuple[Launch, ...], kernels: list[str]
) -> None:
    found = stream_rules.wrong_stream(launches)
    assert [f.kernel for f in found] == kernels, edge
    for f in found:
        assert f.cause == "wrong-device-stream" and f.kind is FindingKind.DEFAULT_STREAM
        assert f.launch_device == "cuda:0"


def test_the_default_stream_finding_names_kernel_device_streams_and_the_fix() -> None:
    sampled = tuple(
        dataclasses.replace(launch, call_site=SourceSite(file="train.py", line=12, function="forward"))
        if launch.seq == 3 else launch
        for launch in SPECIMEN
    )  # fmt: skip
    (f,) = stream_rules.wrong_stream(sampled)
    assert f.count == 4 and f.launch is not None and f.first_seq == 3  # the first launch with a call site
    assert f.launch.call_site is not None and f.tensors == f.launch.tensors
    for part in ("`_gemm`", "cuda:0", "default stream (0x0)", f"0x{SIDE:x}", "`_seg`", "the main thread",
                 "torch.cuda.current_stream(x.device)", "wait_stream"):  # fmt: skip
        assert part in f.message, part
    assert "wait_stream" in CAUSES["wrong-device-stream"].fix
    assert stream_rules.shows(f, at(20, "_gemm", 0)) and not stream_rules.shows(f, at(21, "_gemm", SIDE))
    assert not stream_rules.shows(f, at(22, "_gemm", 0, thread="worker"))
    assert not launch_rules.cross_device(f)  # --strict never stops a launch for it: it is found later
    (d,) = run_findings.diagnoses([record(30, findings=(f,))])
    assert d.cause == "wrong-device-stream" and d.confidence.value == "medium"


def test_a_default_stream_finding_keeps_its_key_as_the_ring_moves() -> None:
    """The example launch of a ring finding changes as the ring slides (another launch of the
    kernel, other tensor names): still one fact per kernel, device and thread."""
    (first,) = stream_rules.wrong_stream(SPECIMEN)
    renamed = tuple(
        dataclasses.replace(launch, tensors=(tensor("a_ptr", "cuda:0"), tensor("b_ptr", "cuda:0")))
        if launch.kernel == "_gemm" else launch
        for launch in SPECIMEN[2:]
    )  # fmt: skip
    (later,) = stream_rules.wrong_stream(renamed)
    assert later.launch is not None and first.launch is not None
    assert later.launch.seq != first.launch.seq and later.tensors != first.tensors
    assert later.key == first.key
    other_thread = tuple(dataclasses.replace(launch, thread="worker") for launch in SPECIMEN)
    (elsewhere,) = stream_rules.wrong_stream(other_thread)
    assert elsewhere.key != first.key
