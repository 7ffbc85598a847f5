"""The launch monitor's hook points and its Monitor, in this process.

The compiled path (``JITFunction.run``) needs a GPU driver: here it is exercised on a stand-in
``triton.runtime.jit`` module with Triton's own signature (``run(self, *args, grid, warmup,
**kwargs)``, checked against the installed Triton) and a driver that says "cuda:0". That is how
a launch of CPU tensors on a GPU is made on a CPU machine: the device checks, the live warning,
--strict, and what becomes of a launch Triton refuses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from qmoe_doctor.core import knobs, launch_observer
from qmoe_doctor.core.launches import FindingKind, HookPoint, ProcessRecord
from qmoe_doctor.core.records import from_json
from qmoe_doctor.monitor import hook
from qmoe_doctor.monitor.bootstrap import sitecustomize as bootstrap  # type: ignore[attr-defined]
from qmoe_doctor.monitor.session import CrossDeviceLaunchError, Monitor, Settings


def kernel_body(x_ptr, y_ptr, n, BLOCK):  # type: ignore[no-untyped-def]  # stands for a @triton.jit function
    return x_ptr, y_ptr, n, BLOCK


class FakeJIT:
    """Triton's JITFunction as the hook sees it: ``fn``, ``arg_names`` and ``run``."""

    calls: list[dict[str, Any]] = []

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.arg_names = list(inspect.signature(fn).parameters)

    def run(self, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        if callable(grid):
            grid = grid({"BLOCK": 16})
        FakeJIT.calls.append({"args": args, "grid": grid, "warmup": warmup})
        if kwargs.get("fail"):
            raise ValueError("Pointer argument (at 1) cannot be accessed from Triton (cpu tensor?)")
        return "launched"

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)


def fake_jit_module() -> ModuleType:
    module = ModuleType("triton.runtime.jit")

    class JITFunction(FakeJIT):
        pass

    active = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: 0x1234)
    module.JITFunction = JITFunction  # type: ignore[attr-defined]
    module.driver = SimpleNamespace(active=active)  # type: ignore[attr-defined]
    return module


@pytest.fixture(autouse=True)
def restored_launch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test leaves the process's launch path as it found it: ``patch_jit`` puts the
    monitor's observer in ``core.launch_observer`` (the slot our kernels' lean path reads in every
    process), and a test may wrap Triton's real ``JITFunction.run``; monkeypatch undoes both."""
    import triton.runtime.jit as jit

    monkeypatch.setattr(launch_observer, "observer", launch_observer.observer)
    monkeypatch.setattr(jit.JITFunction, "run", jit.JITFunction.run)


@pytest.fixture()
def monitored(tmp_path: Path) -> tuple[Monitor, ModuleType, io.StringIO]:
    FakeJIT.calls = []
    warnings = io.StringIO()
    monitor = Monitor(Settings(folder=str(tmp_path), ring=8, call_sites=1), stderr=warnings)
    module = fake_jit_module()
    assert hook.patch_jit(module, monitor)
    return monitor, module, warnings


def read_record(monitor: Monitor) -> ProcessRecord:
    monitor.flush()
    return from_json(ProcessRecord, monitor.writer.path.read_text())


def test_installed_triton_has_the_hook_points_with_the_signature_the_monitor_patches() -> None:
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    params = list(inspect.signature(jit.JITFunction.run).parameters.values())
    assert [p.name for p in params] == ["self", "args", "grid", "warmup", "kwargs"]
    assert params[2].kind is inspect.Parameter.KEYWORD_ONLY and params[3].kind is inspect.Parameter.KEYWORD_ONLY
    assert callable(vars(interpreter.GridExecutor)["__call__"])
    assert hasattr(jit, "driver")


def test_a_launch_on_the_gpu_with_a_cpu_tensor_is_flagged_live(monitored: tuple[Monitor, ModuleType, io.StringIO]) -> None:
    monitor, module, warnings = monitored
    jit = module.JITFunction(kernel_body)
    x, y = torch.ones(4), torch.empty(4)
    assert jit[(1,)](x, y, 4, BLOCK=16) == "launched"
    assert jit[(1,)](x, y, 4, BLOCK=16) == "launched"
    record = read_record(monitor)
    assert record.hooks == (HookPoint.JIT_RUN,)
    first, second = record.ring
    assert first.device == "cuda:0" and first.stream == 0x1234 and first.grid == (1,)
    assert [t.name for t in first.tensors] == ["x_ptr", "y_ptr"] and first.flagged
    (finding,) = record.findings
    assert finding.kind is FindingKind.CPU_TENSOR and finding.cause == "default-device-buffer"
    assert finding.count == 2 and finding.outcome == "ran" and finding.first_seq == 1
    assert finding.launch is not None and finding.launch.call_site is not None
    assert finding.launch.call_site.file == __file__  # the user's line: this test
    # the live warning, once for the two launches
    (line,) = warnings.getvalue().splitlines()
    assert line.startswith("qmoe-doctor: default-device-buffer: `kernel_body` launched on cuda:0")
    assert f"called at {__file__}:" in line


def test_a_refused_pointer_is_the_launchs_outcome_and_the_error_goes_on(
    monitored: tuple[Monitor, ModuleType, io.StringIO],
) -> None:
    monitor, module, _ = monitored
    jit = module.JITFunction(kernel_body)
    with pytest.raises(ValueError, match="cannot be accessed from Triton"):
        jit[(1,)](torch.ones(4), torch.empty(4), 4, BLOCK=16, fail=True)
    record = read_record(monitor)
    assert record.ring[0].raised.startswith("ValueError: Pointer argument (at 1)")
    assert record.findings[0].outcome == "refused"


def test_strict_stops_the_launch_before_it_runs(tmp_path: Path) -> None:
    FakeJIT.calls = []
    monitor = Monitor(Settings(folder=str(tmp_path), strict=True), stderr=io.StringIO())
    module = fake_jit_module()
    hook.patch_jit(module, monitor)
    jit = module.JITFunction(kernel_body)
    with pytest.raises(CrossDeviceLaunchError, match="--strict: default-device-buffer"):
        jit[(1,)](torch.ones(4), torch.empty(4), 4, BLOCK=16)
    assert FakeJIT.calls == []  # never launched
    record = from_json(ProcessRecord, monitor.writer.path.read_text())  # flushed at the stop
    assert record.findings[0].outcome == "stopped" and record.strict


def test_grid_functions_warmup_and_tensor_descriptors(monitored: tuple[Monitor, ModuleType, io.StringIO]) -> None:
    monitor, module, _ = monitored
    jit = module.JITFunction(kernel_body)
    descriptor = SimpleNamespace(base=torch.ones(2, 3))
    jit[lambda meta: (meta["BLOCK"] * 2,)](descriptor, torch.empty(4), 4, BLOCK=16)
    jit.run(torch.ones(4), torch.empty(4), 4, BLOCK=16, grid=(1,), warmup=True)  # compiles only
    record = read_record(monitor)
    assert record.launches == 1 and len(FakeJIT.calls) == 2
    (launch,) = record.ring
    assert launch.grid == (32,)  # what the grid function returned
    assert [t.name for t in launch.tensors] == ["x_ptr.base", "y_ptr"]
    assert launch.tensors[0].shape == (2, 3) and launch.call_site is not None


def test_patching_twice_keeps_one_wrapper(monitored: tuple[Monitor, ModuleType, io.StringIO]) -> None:
    monitor, module, _ = monitored
    wrapper = module.JITFunction.run
    assert hook.patch_jit(module, monitor) and module.JITFunction.run is wrapper
    assert monitor.hooks == [HookPoint.JIT_RUN]


def test_a_failure_inside_the_monitor_never_breaks_the_launch(
    monitored: tuple[Monitor, ModuleType, io.StringIO], monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor, module, _ = monitored

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(monitor, "watch", broken)  # the hot path every hook point goes through
    jit = module.JITFunction(kernel_body)
    assert jit[(1,)](torch.ones(4), torch.empty(4), 4, BLOCK=16) == "launched"
    assert len(FakeJIT.calls) == 1  # launched once, unrecorded
    assert any("a bug of ours" in p for p in monitor.problems)


def test_the_ring_keeps_the_last_launches_only(monitored: tuple[Monitor, ModuleType, io.StringIO]) -> None:
    monitor, module, _ = monitored
    jit = module.JITFunction(kernel_body)
    x = torch.ones(4)
    for _ in range(20):
        jit[(1,)](x, x, 4, BLOCK=16)
    record = read_record(monitor)
    assert record.launches == 20 and [launch.seq for launch in record.ring] == list(range(13, 21))
    assert [launch.call_site is not None for launch in record.ring] == [True] * 8  # each was flagged


def test_settings_come_from_the_variables_run_sets(tmp_path: Path) -> None:
    env = {
        knobs.QMOE_RUN_DIR: str(tmp_path),
        knobs.QMOE_RUN_RING: "16",
        knobs.QMOE_RUN_CALL_SITES: "2",
        knobs.QMOE_RUN_STRICT: "1",
    }
    assert Settings.from_env(env) == Settings(folder=str(tmp_path), ring=16, call_sites=2, strict=True)
    assert Settings.from_env({}) is None
    with pytest.raises(ValueError, match="QMOE_DOCTOR_RUN_RING"):
        Settings.from_env({**env, knobs.QMOE_RUN_RING: "many"})


def test_the_bootstrap_spells_the_variables_as_knobs_declares_them() -> None:
    assert bootstrap.DIR_VARIABLE == knobs.QMOE_RUN_DIR
    assert bootstrap.HOME_VARIABLE == knobs.QMOE_RUN_HOME
    assert set(bootstrap.WATCHED) == set(hook.PATCHES)


def test_records_are_written_whole_and_named_per_process(monitored: tuple[Monitor, ModuleType, io.StringIO]) -> None:
    monitor, _, _ = monitored
    monitor.flush()
    monitor.flush()
    files = list(Path(monitor.settings.folder).iterdir())
    assert [f.name for f in files] == [f"process-{monitor.pid}-{monitor.token}.json"]
    assert json.loads(files[0].read_text())["pid"] == monitor.pid


def _triton_own_run() -> Any:
    """Triton's ``JITFunction.run`` under any wrappers (ours, a profiler's) left on it."""
    import triton.runtime.jit as jit

    run = jit.JITFunction.run
    while hasattr(run, "__wrapped__"):
        run = run.__wrapped__
    return run


def test_our_kernels_lean_launch_path_stays_on_under_the_monitor_and_steps_aside_for_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kernels/launch.py skips JITFunction.run on later calls: under the monitor's wrapper it may,
    since it hands those launches to the monitor's observer; under any other wrapper (a
    profiler's), or the monitor's wrapper with no observer to hand them to, it must not."""
    import triton.runtime.jit as jit

    from qmoe_doctor.kernels import launch

    own = _triton_own_run()
    monkeypatch.setattr(jit.JITFunction, "run", own)  # whatever ran before this test
    monkeypatch.setattr(launch_observer, "observer", None)
    assert launch._plain_triton_run()

    monitor = Monitor(Settings(folder=str(tmp_path)), stderr=io.StringIO())
    assert hook.patch_jit(jit, monitor)
    assert jit.JITFunction.run is not own and launch_observer.observer == monitor.observe
    assert launch._plain_triton_run()  # the lean path stays on: its launches reach the monitor

    monkeypatch.setattr(launch_observer, "observer", None)
    assert not launch._plain_triton_run()  # nobody to hand them to: Triton's path, wrapped

    def profiled(self: Any, *args: Any, **kwargs: Any) -> Any:
        return own(self, *args, **kwargs)

    profiled.__wrapped__ = own  # type: ignore[attr-defined]
    monkeypatch.setattr(jit.JITFunction, "run", profiled)
    monkeypatch.setattr(launch_observer, "observer", monitor.observe)
    assert not launch._plain_triton_run()  # a wrapper not ours sees every launch


class _Compiled:
    """A compiled kernel: ``run`` is the launcher, called with the lean path's arguments."""

    function, packed_metadata = "fn", "meta"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.src = SimpleNamespace(fn=SimpleNamespace(arg_names=["x_ptr", "y_ptr", "n", "BLOCK"]))

    def run(self, *args: Any) -> None:
        self.calls.append(args)


class _LeanKernel(FakeJIT):
    """A JITFunction whose ``kernel[grid](**kwargs)`` returns a compiled kernel (Triton's does)."""

    def __init__(self, fn: Any) -> None:
        super().__init__(fn)
        self.pre_run_hooks: list[Any] = []
        self.compiled = _Compiled()

    def __getitem__(self, grid: Any) -> Any:
        def call(**kwargs: Any) -> Any:
            FakeJIT.calls.append({"args": (), "grid": grid, "warmup": False})
            return self.compiled

        return call


@pytest.fixture()
def lean_plan(monkeypatch: pytest.MonkeyPatch) -> Any:
    """kernels/launch.py as on a GPU (no interpreter, Triton's hooks idle, a stream, no CUDA
    guard), and a plan ``Launch`` of a stand-in kernel on cuda:0 whose first call compiled it."""
    from qmoe_doctor.kernels import launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(launch, "_plain_triton_run", lambda: True)
    idle = SimpleNamespace(calls=[])
    monkeypatch.setattr(launch._Runtime, "ready", True)
    monkeypatch.setattr(launch._Runtime, "knobs", SimpleNamespace(launch_enter_hook=idle, launch_exit_hook=idle))
    monkeypatch.setattr(launch._Runtime, "stream", staticmethod(lambda index: 0x1234))
    monkeypatch.setattr(launch, "_device_guard", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(launch, "_current_device", lambda: -1)  # no CUDA here: always "another device"
    FakeJIT.calls = []
    kernel = _LeanKernel(kernel_body)
    plan = launch.Launch(kernel, 1, {"n": 4, "BLOCK": 16}, ("x_ptr", "y_ptr"), {}, device_index=0)
    plan(torch.ones(4), torch.empty(4))  # the first call: through kernel[grid], compiled
    assert plan.lean
    return plan


def test_the_monitor_records_and_checks_our_kernels_lean_launches(
    monitored: tuple[Monitor, ModuleType, io.StringIO], lean_plan: Any
) -> None:
    monitor, _, warnings = monitored
    x, y = torch.ones(4), torch.empty(4)  # CPU tensors on a cuda:0 launch: a finding
    lean_plan(x, y)
    lean_plan(x, y)
    compiled = lean_plan.kernel.compiled
    assert len(compiled.calls) == 2 and len(FakeJIT.calls) == 1  # launched by the launcher, once each
    assert compiled.calls[0][:4] == (1, 1, 1, 0x1234) and compiled.calls[0][-4:] == (x, y, 4, 16)
    record = read_record(monitor)
    assert record.launches == 2
    first, second = record.ring
    assert first.kernel == "kernel_body" and first.device == "cuda:0" and first.grid == (1, 1, 1)
    assert [t.name for t in first.tensors] == ["x_ptr", "y_ptr"] and first.flagged
    assert [t.data_ptr for t in second.tensors] == [x.data_ptr(), y.data_ptr()]
    (finding,) = record.findings
    assert finding.kind is FindingKind.CPU_TENSOR and finding.count == 2 and finding.outcome == "ran"
    assert "default-device-buffer" in warnings.getvalue()


def test_strict_stops_a_lean_launch_and_a_broken_monitor_still_makes_it(
    monitored: tuple[Monitor, ModuleType, io.StringIO], lean_plan: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor, _, _ = monitored
    compiled = lean_plan.kernel.compiled
    monkeypatch.setattr(monitor, "settings", dataclasses.replace(monitor.settings, strict=True))
    with pytest.raises(CrossDeviceLaunchError, match="--strict: default-device-buffer"):
        lean_plan(torch.ones(4), torch.empty(4))
    assert compiled.calls == []  # never launched

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(monitor, "watch", broken)
    lean_plan(torch.ones(4), torch.empty(4))
    assert len(compiled.calls) == 1 and lean_plan.lean
    assert any("a bug of ours" in p for p in monitor.problems)


def test_unsampled_launches_take_the_sizes_of_a_sampled_launch_of_the_same_buffers(tmp_path: Path) -> None:
    """Past a kernel's first launches only every SAMPLE_EVERY-th is read whole; the record gives
    the others' tensors the facts of a sampled launch of the same argument at the same address
    (a plan's buffers), and a new address stays without a size rather than take a wrong one."""
    module = fake_jit_module()
    # the launch device is the one CPU tensors report: every launch passes the pre-check
    module.driver = SimpleNamespace(  # type: ignore[attr-defined]
        active=SimpleNamespace(get_current_device=lambda: -1, get_current_stream=lambda device: 0)
    )
    monitor = Monitor(Settings(folder=str(tmp_path), ring=8, call_sites=1), stderr=io.StringIO())
    assert hook.patch_jit(module, monitor)
    jit = module.JITFunction(kernel_body)
    x, y, z = torch.ones(4), torch.empty(4), torch.empty(2, 3)
    for _ in range(3):
        jit[(1,)](x, y, 4, BLOCK=16)
    jit[(1,)](z, y, 4, BLOCK=16)
    record = read_record(monitor)
    assert record.launches == 4 and monitor.sampled == 1 and not record.findings
    first, second, third, fourth = record.ring
    assert first.call_site is not None and second.call_site is None  # sampled, then not
    for launch in (first, second, third):
        assert [(t.name, t.shape, t.nbytes) for t in launch.tensors] == [("x_ptr", (4,), 16), ("y_ptr", (4,), 16)]
    assert [(t.name, t.data_ptr, t.nbytes) for t in fourth.tensors] == [
        ("x_ptr", z.data_ptr(), 0),  # a buffer no sampled launch read: no size
        ("y_ptr", y.data_ptr(), 16),
    ]


def seg_body(rows_ptr, out_ptr, n, BLOCK):  # type: ignore[no-untyped-def]  # a segment sum's stand-in
    return rows_ptr, out_ptr, n, BLOCK


def gemm_body(x_ptr, y_ptr, n, BLOCK):  # type: ignore[no-untyped-def]  # a grouped GEMM's stand-in
    return x_ptr, y_ptr, n, BLOCK


def test_a_kernel_on_the_default_stream_among_side_stream_launches_is_found_at_the_flush(tmp_path: Path) -> None:
    """The wrong_stream specimen's pattern through the monitor: the stream each launch recorded
    (the driver's current stream) is read from the ring when the record is written, not at the
    launch; a later flush counts the launches made since, once."""
    side = 0x55D0C3A0
    current = {"stream": side}
    module = fake_jit_module()
    module.driver = SimpleNamespace(  # type: ignore[attr-defined]
        # the launch device is the one CPU tensors report: every launch passes the device pre-check
        active=SimpleNamespace(get_current_device=lambda: -1, get_current_stream=lambda device: current["stream"])
    )
    warnings = io.StringIO()
    monitor = Monitor(Settings(folder=str(tmp_path), ring=16, call_sites=1), stderr=warnings)
    assert hook.patch_jit(module, monitor)
    seg, gemm = module.JITFunction(seg_body), module.JITFunction(gemm_body)
    x, y = torch.ones(4), torch.empty(4)

    def forward() -> None:  # as MoEBlock.forward under a side stream, on the specimen
        current["stream"] = side
        seg[(1,)](x, y, 4, BLOCK=16)
        current["stream"] = 0  # torch.cuda.stream(torch.cuda.default_stream(x.device))
        gemm[(1,)](x, y, 4, BLOCK=16)
        gemm[(1,)](x, y, 4, BLOCK=16)
        current["stream"] = side
        seg[(1,)](x, y, 4, BLOCK=16)

    forward()
    assert not monitor.findings  # nothing at the launches (their first ones flushed before the pattern)
    record = read_record(monitor)
    (f,) = record.findings
    assert f.kind is FindingKind.DEFAULT_STREAM and f.cause == "wrong-device-stream" and f.kernel == "gemm_body"
    assert f.count == 2 and f.launch is not None and f.launch.stream == 0 and f.launch.call_site is not None
    assert [launch.stream for launch in record.ring] == [side, 0, 0, side]
    (line,) = warnings.getvalue().splitlines()
    assert line.startswith("qmoe-doctor: wrong-device-stream: `gemm_body`") and f"0x{side:x}" in line
    forward()
    assert read_record(monitor).findings[0].count == 4  # the two launches made since
    assert read_record(monitor).findings[0].count == 4  # and no launch counted twice
    assert len(warnings.getvalue().splitlines()) == 1  # warned once


def test_local_rank_is_read_once_when_the_monitor_attaches_and_reaches_the_device_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qmoe_doctor.monitor import session

    checked: list[Any] = []
    check = session.check_launch
    monkeypatch.setattr(session, "check_launch", lambda facts, peer=None: checked.append(facts) or check(facts, peer))
    monkeypatch.setenv("LOCAL_RANK", "1")
    FakeJIT.calls = []
    monitor = Monitor(Settings(folder=str(tmp_path)), stderr=io.StringIO())
    module = fake_jit_module()
    assert hook.patch_jit(module, monitor)
    monkeypatch.setenv("LOCAL_RANK", "5")  # read once: a later change is not seen
    module.JITFunction(kernel_body)[(1,)](torch.ones(4), torch.empty(4), 4, BLOCK=16)  # CPU tensors on cuda:0
    assert [facts.local_rank for facts in checked] == [1]
    assert read_record(monitor).local_rank == 1
