"""The specimens on real GPUs: each misbehaves exactly as its docstring says, the correct kernel
stays right under the same condition.

Every scenario runs in a fresh child process (peer access, contexts and the autotuner's cache
are per-process state that a previous case would leave behind). The child prints one JSON line
per kernel call and flushes it before the next, so a call that poisons the CUDA context still
leaves the earlier results. Pair scenarios follow FINDINGS.md: operands on cuda:1, cuda:0
current.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.core import knobs
from qmoe_doctor.core.specimens import kernel_ref
from qmoe_doctor.core.tolerances import tolerance

CORRECT = "qmoe_doctor.kernels.grouped_gemm:moe_grouped_gemm"
TOL_BF16 = tolerance("bfloat16")  # ||out - ref|| / ||ref|| vs the float32 twin; 1.7e-3 on H200
POINTER_CHECK = "cannot be accessed from Triton"  # Triton's launch-time pointer check

_CHILD = r"""
import importlib, json, math, sys, time
import torch
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch
from qmoe_doctor.probes.stream_hold import hold_stream

SCENARIO = sys.argv[1]
KERNELS = json.loads(sys.argv[2])  # [[label, "module:function"], ...]
HOLD_S = 1.0  # the producer's wait (probes/stream_hold.py); a kernel here takes < 10 ms


def load(ref):
    module, function = ref.split(":")
    return getattr(importlib.import_module(module), function)


def emit(**fields):
    print(json.dumps(fields), flush=True)


def operands(device, m=4096, e=128, n=768, k=2048, sizes=None, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
    w = torch.randn(e, n, k, device=device, dtype=torch.bfloat16, generator=gen)
    if sizes is None:  # random routing: every expert gets some rows, some get none
        picks = torch.randint(e, (m,), generator=torch.Generator().manual_seed(seed))
        sizes = torch.bincount(picks, minlength=e)
    m_sizes = torch.as_tensor(sizes, dtype=torch.int32).to(device)
    return x, w, m_sizes


def rel_error(y, x, w, m_sizes):
    # compare on the CPU: a cross-device copy would itself enable peer access
    ref = moe_grouped_gemm_torch(x, w, m_sizes, out_dtype=torch.float32).cpu()
    err = float((y.float().cpu() - ref).norm() / ref.norm())
    return err if math.isfinite(err) else float("inf")


def sync(*devices):
    for d in devices:
        torch.cuda.synchronize(d)


def call(label, fn, x, w, m_sizes, devices, **extra):
    try:
        y = fn(x, w, m_sizes)
        sync(*devices)
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        emit(kernel=label, error=f"{type(exc).__name__}: {first}", **extra)
        return None
    emit(kernel=label, error=None, device=str(y.device), rel=rel_error(y, x, w, m_sizes), **extra)
    return y


def timed(fn, x, w, m_sizes, devices, reps=10):
    fn(x, w, m_sizes)  # compile and warm up
    sync(*devices)
    start = time.perf_counter()
    for _ in range(reps):
        fn(x, w, m_sizes)
    sync(*devices)
    return (time.perf_counter() - start) / reps * 1e3


if SCENARIO == "untouched":  # cuda:0 current (the default) but never touched: no context on it
    x, w, m_sizes = operands("cuda:1")
    for label, ref in KERNELS:
        call(label, load(ref), x, w, m_sizes, (1,))

elif SCENARIO in ("no-peer", "peer", "peer-both"):
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # cuda:0's context exists
    x, w, m_sizes = operands("cuda:1")
    if SCENARIO in ("peer", "peer-both"):
        torch.ones(4, device="cuda:0").to("cuda:1")  # enables peer access 0 -> 1
    if SCENARIO == "peer-both":
        torch.ones(4, device="cuda:1").to("cuda:0")  # and 1 -> 0
    sync(0, 1)
    for label, ref in KERNELS:
        call(label, load(ref), x, w, m_sizes, (0, 1))

elif SCENARIO == "peer-timing":  # FINDINGS: 12x slower unguarded at M=16384, N=1536
    torch.cuda.set_device(0)
    torch.ones(4, device="cuda:0").to("cuda:1")
    x, w, m_sizes = operands("cuda:1", m=16384, e=128, n=1536, k=2048)
    for label, ref in KERNELS:
        fn = load(ref)
        y = call(label, fn, x, w, m_sizes, (0, 1))
        if y is not None:
            emit(kernel=label, ms=timed(fn, x, w, m_sizes, (0, 1)))

elif SCENARIO == "producer-race":  # x still being written on cuda:1's stream
    torch.cuda.set_device(0)
    torch.ones(4, device="cuda:0").to("cuda:1")
    x, w, m_sizes = operands("cuda:1")
    src = x.clone()
    for label, ref in KERNELS:
        x.fill_(float("nan"))  # stale contents: what an unordered reader sees
        sync(1)
        with torch.cuda.device(1):  # the producer, on cuda:1's current stream
            hold_stream(HOLD_S)
            x.copy_(src)
        call(label, load(ref), x, w, m_sizes, (0, 1))

elif SCENARIO == "side-stream":  # one device: the caller's current stream is a side stream
    dev = torch.cuda.device_count() - 1
    torch.cuda.set_device(dev)
    x, w, m_sizes = operands(f"cuda:{dev}")
    src = x.clone()
    side = torch.cuda.Stream(device=dev)
    for label, ref in KERNELS:  # compile first: a compile longer than the hold ends the race
        load(ref)(src, w, m_sizes)
    torch.cuda.synchronize(dev)
    for label, ref in KERNELS:
        x.fill_(float("nan"))
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            hold_stream(HOLD_S)
            x.copy_(src)  # the producer, still queued behind the hold
            call(label, load(ref), x, w, m_sizes, (dev,))

elif SCENARIO.startswith("int32:"):  # "int32:E:FIRST_HOT": rows on experts FIRST_HOT.. E-1
    _, e, first_hot = SCENARIO.split(":")
    e, first_hot = int(e), int(first_hot)
    n, k, m = 5120, 6144, 256
    need = e * n * k * 2 + (2 << 30)
    free, _ = torch.cuda.mem_get_info(0)
    if free < need:
        emit(kernel="*", skipped=f"needs {need / 2**30:.1f} GiB free on cuda:0, has {free / 2**30:.1f}")
        sys.exit(0)
    sizes = [0] * e
    hot = list(range(first_hot, e))
    for i in range(m):
        sizes[hot[i % len(hot)]] += 1
    x, w, m_sizes = operands("cuda:0", m=m, e=e, n=n, k=k, sizes=sizes)
    for label, ref in KERNELS:  # the correct one first: a wrapped read may poison the context
        call(label, load(ref), x, w, m_sizes, (0,))

elif SCENARIO == "repeat-call":  # fresh process: the first call for an autotune key
    x, w, m_sizes = operands("cuda:0", m=2048, e=16, n=512, k=1024)
    for label, ref in KERNELS:
        fn = load(ref)
        for i in range(3):
            call(label, fn, x, w, m_sizes, (0,), call_index=i)

else:
    raise SystemExit(f"unknown scenario {SCENARIO}")
"""


def _run(scenario: str, **kernels: str) -> dict[str, list[dict[str, Any]]]:
    """Run one scenario in a fresh child; results per kernel label, in call order."""
    env = {k: v for k, v in os.environ.items() if k != knobs.TRITON_INTERPRET}
    env.update(knobs.NVLS_OFF)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD), scenario, json.dumps(list(kernels.items()))],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    results: dict[str, list[dict[str, Any]]] = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            doc = json.loads(line)
            if "skipped" in doc:
                pytest.skip(doc["skipped"])
            results.setdefault(doc["kernel"], []).append(doc)
    missing = [label for label in kernels if label not in results]
    assert not missing, f"no result for {missing}; rc={out.returncode}\nstderr:\n{out.stderr[-3000:]}"
    return results


def _right(doc: dict[str, Any], device: str | None = None) -> bool:
    return doc["error"] is None and doc["rel"] <= TOL_BF16 and (device is None or doc["device"] == device)


def _wrong(doc: dict[str, Any]) -> bool:
    return doc["error"] is None and not doc["rel"] <= TOL_BF16  # inf (NaN read) counts as wrong


def _pointer_error(doc: dict[str, Any]) -> bool:
    return doc["error"] is not None and doc["error"].startswith("ValueError") and POINTER_CHECK in doc["error"]


# --------------------------------------------------------------------------------------------
# Placement: operands on cuda:1, cuda:0 current
# --------------------------------------------------------------------------------------------


@pytest.mark.multigpu
def test_no_peer_access_unguarded_and_default_buffer_fail_the_pointer_check() -> None:
    r = _run(
        "no-peer",
        correct=CORRECT,
        unguarded=kernel_ref("unguarded"),
        default_buffer=kernel_ref("default_buffer"),
    )
    assert _right(r["correct"][0], "cuda:1")
    assert _pointer_error(r["unguarded"][0]), r["unguarded"]  # x (argument 0) on cuda:1
    assert _pointer_error(r["default_buffer"][0]), r["default_buffer"]  # y (argument 2) on cuda:0


@pytest.mark.multigpu
def test_untouched_current_device_unguarded_works_by_accident_default_buffer_does_not() -> None:
    # FINDINGS: with no context on cuda:0 the unguarded launch runs in cuda:1's context. The
    # default buffer creates cuda:0's context itself, so it fails even here: the two differ.
    unguarded = _run("untouched", unguarded=kernel_ref("unguarded"))
    assert _right(unguarded["unguarded"][0], "cuda:1"), unguarded
    default_buffer = _run("untouched", default_buffer=kernel_ref("default_buffer"))
    doc = default_buffer["default_buffer"][0]
    assert doc["error"] is not None or doc["device"] != "cuda:1", doc


@pytest.mark.multigpu
def test_peer_access_unguarded_is_right_but_remote_and_slow() -> None:
    r = _run("peer-timing", correct=CORRECT, unguarded=kernel_ref("unguarded"))
    correct_call, correct_time = r["correct"]
    unguarded_call, unguarded_time = r["unguarded"]
    assert _right(correct_call, "cuda:1")
    assert _right(unguarded_call, "cuda:1"), unguarded_call  # numbers right: peer reads
    ratio = unguarded_time["ms"] / correct_time["ms"]
    assert ratio >= knobs.SLOW_FACTOR, f"unguarded only {ratio:.1f}x slower than guarded"


@pytest.mark.multigpu
@pytest.mark.parametrize("scenario", ["peer", "peer-both"])
def test_default_buffer_errors_or_returns_y_on_the_wrong_device(scenario: str) -> None:
    r = _run(scenario, correct=CORRECT, default_buffer=kernel_ref("default_buffer"))
    assert _right(r["correct"][0], "cuda:1")
    doc = r["default_buffer"][0]
    if scenario == "peer":  # only 0 -> 1 is on; the kernel runs on cuda:1 and writes cuda:0
        assert _pointer_error(doc), doc
    else:  # 1 -> 0 on too: y written remotely and returned on cuda:0
        assert doc["error"] is not None or doc["device"] == "cuda:0", doc


@pytest.mark.multigpu
def test_unguarded_reads_stale_input_under_a_pending_producer() -> None:
    r = _run("producer-race", correct=CORRECT, unguarded=kernel_ref("unguarded"))
    assert _right(r["correct"][0], "cuda:1")  # launched on cuda:1's stream, after the producer
    doc = r["unguarded"][0]  # on cuda:0's stream, unordered: reads the NaN x (or faults)
    assert _wrong(doc) or doc["error"] is not None, doc


# --------------------------------------------------------------------------------------------
# One GPU
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_wrong_stream_reads_stale_input_behind_a_side_stream_producer() -> None:
    r = _run("side-stream", correct=CORRECT, wrong_stream=kernel_ref("wrong_stream"))
    assert _right(r["correct"][0])  # on the caller's side stream: after the producer
    assert _wrong(r["wrong_stream"][0]), r["wrong_stream"]  # on the default stream: before it


@pytest.mark.gpu
@pytest.mark.parametrize(
    "scenario",
    [
        # FINDINGS' case: rows on the last 8 of 160 experts of 5120x6144 (10 GB): the wrapped
        # offset lands inside w, silently wrong (rel. error 1.41 measured)
        pytest.param("int32:160:152", id="160-experts-last-8"),
        # the first wrapping expert: 69 * 5120 * 6144 > 2**31 - 1 (4.4 GB): the wrapped offset
        # points 4.2 GB before w, so the read may also fault instead of returning garbage
        pytest.param("int32:70:69", id="70-experts-expert-69"),
    ],
)
def test_int32_offsets_is_wrong_past_the_boundary(scenario: str) -> None:
    r = _run(scenario, correct=CORRECT, int32_offsets=kernel_ref("int32_offsets"))
    assert _right(r["correct"][0], "cuda:0")
    doc = r["int32_offsets"][0]
    if scenario == "int32:160:152":
        assert _wrong(doc), doc
    else:
        assert _wrong(doc) or doc["error"] is not None, doc


@pytest.mark.gpu
def test_autotune_inplace_is_wrong_on_the_first_call_only() -> None:
    r = _run("repeat-call", correct=CORRECT, autotune_inplace=kernel_ref("autotune_inplace"))
    assert all(_right(doc) for doc in r["correct"])
    first, *later = r["autotune_inplace"]
    assert _wrong(first), first
    assert all(_right(doc) for doc in later), later


# --------------------------------------------------------------------------------------------
# The specimens in the public kernels' style, through the real CLI on one GPU: the verdict each
# must get (docs/validation/scan-specimens.md). Each scan is a `qmoe-doctor scan --gpus 0`
# process of its own with a Triton cache folder of its own (cold), so the wall time in its JSON
# report is a cold-cache time; run the command in the docstring below for cold and warm times.
# --------------------------------------------------------------------------------------------


def _scan_gpu0(kernel: str, tmp: Any, *extra: str, cache: Any = None) -> tuple[int, dict[str, Any]]:
    """``qmoe-doctor scan --gpus 0 --kernel KERNEL --json`` in a child: (exit code, report)."""
    env = {k: v for k, v in os.environ.items() if k != knobs.TRITON_INTERPRET}
    env.update(knobs.NVLS_OFF)
    env[knobs.TRITON_CACHE_DIR] = str(cache or tmp / "triton-cache")
    out = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", "scan", "--gpus", "0", "--kernel", kernel, "--json",
         "--log-dir", str(tmp / "logs"), *extra],
        capture_output=True, text=True, timeout=900, env=env, check=False,
    )  # fmt: skip
    assert out.stdout.strip().startswith("{"), f"rc={out.returncode}\n{out.stderr[-3000:]}"
    return out.returncode, json.loads(out.stdout)


def _cells(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["probe_id"].split("/", 1)[1]: o for o in report["outcomes"]}


@pytest.mark.gpu
def test_running_row_mask_is_caught_writing_past_its_own_y(tmp_path: Any) -> None:
    rc, report = _scan_gpu0("specimen:running_row_mask", tmp_path, "--no-sweeps")
    assert rc == 1
    assert [d["cause"] for d in report["diagnoses"]] == ["invalid-routing"] and not report["unexplained"]
    over = _cells(report)["over-routed"]
    assert over["status"] == "wrong" and "after y" in over["canary_hits"], over
    assert over["facts"]["output_guard"] is True


@pytest.mark.gpu
def test_unmasked_rows_is_caught_by_the_over_routed_cell_itself(tmp_path: Any) -> None:
    rc, report = _scan_gpu0("specimen:unmasked_rows", tmp_path, "--only", "single,over-routed")
    assert rc == 1
    (diag,) = report["diagnoses"]
    assert diag["cause"] == "invalid-routing" and diag["severity"] == "fault"
    assert any("after y" in e["detail"] for e in diag["evidence"]), diag["evidence"]


@pytest.mark.gpu
def test_contiguous_only_is_healthy_with_its_strided_cells_rejected(tmp_path: Any) -> None:
    rc, report = _scan_gpu0("specimen:contiguous_only", tmp_path, "--only", "single,offsets")
    assert rc == 0 and not report["diagnoses"] and not report["unexplained"], report["unexplained"]
    cells = _cells(report)
    for variant, operand in (("padded-rows", "x"), ("transposed-w", "w")):
        cell = cells[f"offsets:{variant}"]
        assert cell["error_kind"] == "bad-input" and cell["facts"]["raised_in"] == "kernel", cell
        assert cell["facts"]["kernel_launches"] == 0
        assert any(f"offsets:{variant}: {operand} (" in e for e in report["explanations"]), report["explanations"]


@pytest.mark.gpu
def test_autotuned_is_healthy_and_only_repeat_call_benchmarks(tmp_path: Any) -> None:
    """A default one-GPU scan (sweeps on), cold Triton cache. Its wall time is in the report
    (``wall_s``); the 60 s target is recorded in docs/validation/scan-specimens.md, not asserted."""
    rc, report = _scan_gpu0("specimen:autotuned", tmp_path)
    assert rc == 0 and not report["diagnoses"] and not report["unexplained"]
    cells = _cells(report)
    assert cells["repeat-call"]["facts"]["first_call_autotune_benchmarked"] is True
    others = [c for name, c in cells.items() if name != "repeat-call" and "autotuned_launches" in c["facts"]]
    assert others and not any(c["facts"]["autotune_benchmarked"] for c in others)
    print(f"specimen:autotuned scan --gpus 0, cold Triton cache: {report['wall_s']:.1f} s")


@pytest.mark.gpu
def test_cached_sms_scan_is_healthy_and_lint_names_its_cause(tmp_path: Any) -> None:
    rc, report = _scan_gpu0("specimen:cached_sms", tmp_path, "--no-sweeps")
    assert rc == 0 and not report["diagnoses"] and not report["unexplained"]  # identical GPUs
    env = {k: v for k, v in os.environ.items() if k != knobs.TRITON_INTERPRET}
    out = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", "lint", "kernels/specimens/cached_sms.py", "--json"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )  # fmt: skip
    assert out.returncode == 1
    assert {f["cause"] for f in json.loads(out.stdout)["findings"]} == {"per-device-state-cached"}


@pytest.mark.gpu
def test_int32_debug_rerun_names_the_source_line_and_operation(tmp_path: Any) -> None:
    rc, report = _scan_gpu0("specimen:int32_offsets", tmp_path, "--only", "single,int32-boundary")
    assert rc == 1
    (diag,) = report["diagnoses"]
    sites = [e for e in diag["evidence"] if e.get("site")]
    assert sites, diag["evidence"]
    path, _, line = sites[0]["site"].rpartition(":")
    assert path.endswith("int32_offsets.py"), sites[0]
    source = Path(path).read_text(encoding="utf-8").splitlines()[int(line) - 1]
    assert "stride_we" in source or "w_ptrs" in source, source  # the planted product's statement
    assert sites[0]["check"] == "int32 overflow detected for operation mul"


# --------------------------------------------------------------------------------------------
# The persistent TMA-descriptor design (device-side descriptors, scratch from
# triton.set_allocator, a grid of the SM count, w flattened to (E*N, K)): the correct twin, the
# two faults planted in it, and the flat-weight adapter on real launches. The verdicts are the
# calibration table's rows (docs/validation/scan-specimens.md).
# --------------------------------------------------------------------------------------------

_TMA_CHILD = r"""
import importlib, json, sys
import torch
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch

KERNELS = json.loads(sys.argv[1])  # [[label, "module:function"], ...], the correct one first
dev = "cuda:0"
gen = torch.Generator(device=dev).manual_seed(0)
m, e, n, k = 4096, 128, 768, 2048
x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=gen)
w = torch.randn(e, n, k, device=dev, dtype=torch.bfloat16, generator=gen)
m_sizes = torch.bincount(torch.randint(e, (m,), generator=torch.Generator().manual_seed(0)), minlength=e)
m_sizes = m_sizes.to(torch.int32).to(dev)
# x one element (2 bytes) into its storage: the scan's offsets: storage-offset-1 view
buf = torch.empty(x.numel() + 64, device=dev, dtype=x.dtype)
x_off = buf[1 : 1 + x.numel()].view(m, k)
x_off.copy_(x)
ref = moe_grouped_gemm_torch(x, w, m_sizes, out_dtype=torch.float32)
for label, target in KERNELS:  # one line each, flushed: a sticky fault ends every later call
    module, function = target.split(":")
    try:
        y = getattr(importlib.import_module(module), function)(x_off, w, m_sizes)
        torch.cuda.synchronize()
        rel = float((y.float() - ref).norm() / ref.norm())
        print(json.dumps({"kernel": label, "error": None, "rel": rel}), flush=True)
    except Exception as exc:  # noqa: BLE001 - the error is the observation
        print(json.dumps({"kernel": label, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


@pytest.mark.gpu
def test_tma_misaligned_x_faults_with_a_misaligned_address_and_the_twin_copies_it() -> None:
    """x two bytes into its storage, bf16: the twin copies it into an aligned buffer and is
    right; the specimen makes its descriptors on it and dies of the sticky CUDA error."""
    env = {k: v for k, v in os.environ.items() if k != knobs.TRITON_INTERPRET}
    kernels = [["twin", kernel_ref("tma_persistent")], ["misaligned", kernel_ref("tma_misaligned")]]
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_TMA_CHILD), json.dumps(kernels)],
        capture_output=True, text=True, timeout=600, env=env, check=False,
    )  # fmt: skip
    docs = {d["kernel"]: d for d in map(json.loads, (ln for ln in out.stdout.splitlines() if ln.startswith("{")))}
    assert set(docs) == {"twin", "misaligned"}, f"rc={out.returncode}\n{out.stderr[-3000:]}"
    assert docs["twin"]["error"] is None and docs["twin"]["rel"] <= TOL_BF16, docs["twin"]
    assert docs["misaligned"]["error"] is not None and "misaligned address" in docs["misaligned"]["error"], docs


@pytest.mark.gpu
def test_tma_persistent_is_healthy_in_every_one_gpu_cell(tmp_path: Any) -> None:
    """The default one-GPU scan (sweeps and the int32 boundary on): no diagnosis, nothing
    unexplained; its storage-offset-1 cell passes (the operands copied, not refused)."""
    rc, report = _scan_gpu0("specimen:tma_persistent", tmp_path)
    assert rc == 0 and not report["diagnoses"] and not report["unexplained"], report["unexplained"]
    cells = _cells(report)
    assert cells["offsets:storage-offset-1"]["status"] == "pass"
    assert cells["over-routed"]["status"] == "pass" and cells["over-routed"]["facts"]["output_guard"] is True


@pytest.mark.gpu
def test_tma_unmasked_rows_tma_stores_past_y_are_invalid_routing(tmp_path: Any) -> None:
    rc, report = _scan_gpu0("specimen:tma_unmasked_rows", tmp_path, "--only", "single,over-routed,negative-sizes")
    assert rc == 1
    assert [d["cause"] for d in report["diagnoses"]] == ["invalid-routing"] and not report["unexplained"]
    over = _cells(report)["over-routed"]
    assert over["status"] == "wrong" and "after y" in over["canary_hits"], over
    assert over["facts"]["rows_written_after_y"] == 64


@pytest.mark.gpu
def test_tma_misaligned_is_misaligned_operand_from_the_storage_offset_cell_alone(tmp_path: Any) -> None:
    rc, report = _scan_gpu0("specimen:tma_misaligned", tmp_path, "--only", "single,offsets")
    assert rc == 1
    assert [d["cause"] for d in report["diagnoses"]] == ["misaligned-operand"] and not report["unexplained"]
    cells = _cells(report)
    failing = {name for name, cell in cells.items() if cell["status"] not in ("pass", "skipped")}
    assert failing == {"offsets:storage-offset-1"}, failing  # 16 bytes in (storage-offset-8) passes
    assert "misaligned address" in (cells["offsets:storage-offset-1"]["error_message"] or ""), cells


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("specimen", "causes"), [("tma_persistent", []), ("tma_unmasked_rows", ["invalid-routing"])]
)
def test_flat_weights_adapter_scans_the_kernels_own_entry_point(specimen: str, causes: list[str], tmp_path: Any) -> None:
    """The kernel's (x, w2d, m_sizes) entry point through ``adapter:flat-weights``: the same
    verdict as the specimen's own three-line wrapper."""
    module = kernel_ref(specimen).split(":")[0]
    ref = f"adapter:flat-weights:{module}:grouped_gemm_flat"
    rc, report = _scan_gpu0(ref, tmp_path, "--only", "single,over-routed,offsets")
    assert rc == (1 if causes else 0), report["unexplained"]
    assert [d["cause"] for d in report["diagnoses"]] == causes and not report["unexplained"]
    assert all(c["status"] != "skipped" for c in _cells(report).values() if c["spec"]["condition"] != "launch-config")
