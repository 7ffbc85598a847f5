"""The launch monitor's hook points and its Monitor, in this process.

The compiled path (``JITFunction.run``) needs a GPU driver: here it is exercised on a stand-in
``triton.runtime.jit`` module with Triton's own signature (``run(self, *args, grid, warmup,
**kwargs)``, checked against the installed Triton) and a driver that says "cuda:0". That is how
a launch of CPU tensors on a GPU is made on a CPU machine: the device checks, the live warning,
--strict, and what becomes of a launch Triton refuses.
"""

from __future__ import annotations

import inspect
import io
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from qmoe_doctor.core import knobs
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

    monkeypatch.setattr(monitor, "launch", broken)
    jit = module.JITFunction(kernel_body)
    assert jit[(1,)](torch.ones(4), torch.empty(4), 4, BLOCK=16) == "launched"
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


def test_our_kernels_lean_launch_path_steps_aside_for_the_monitor(tmp_path: Path) -> None:
    """kernels/launch.py skips JITFunction.run on later calls unless it is wrapped: the monitor's
    wrapper must be recognised, or it would miss every launch after a plan's first."""
    import triton.runtime.jit as jit

    from qmoe_doctor.kernels import launch

    original = jit.JITFunction.run
    assert launch._plain_triton_run()
    try:
        assert hook.patch_jit(jit, Monitor(Settings(folder=str(tmp_path)), stderr=io.StringIO()))
        assert not launch._plain_triton_run()
    finally:
        jit.JITFunction.run = original
