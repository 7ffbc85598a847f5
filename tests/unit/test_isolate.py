"""isolate.worker_pool + probes/worker.py: the parent survives whatever a probe child does.

The children run self-test probes (no torch): they crash, hang, exit and raise CUDA-looking
errors on purpose. Every test runs on a CPU in a few seconds at most.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import pytest

import qmoe_doctor.probes
from qmoe_doctor.core import knobs
from qmoe_doctor.core.events import Event, EventKind
from qmoe_doctor.core.records import Condition, ErrorKind, Outcome, Phase, ProbeSpec, Shape, Status, to_json
from qmoe_doctor.isolate.one_shot import run_one
from qmoe_doctor.isolate.process import child_env, child_python
from qmoe_doctor.isolate.worker_pool import run_session
from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.worker import execute

pytestmark = pytest.mark.timeout(120)

SHAPE = Shape(m=8, e=2, n=4, k=4, dtype="float32")
ILLEGAL = "CUDA error: an illegal memory access was encountered"


def spec(probe_id: str, condition: Condition, **kwargs: Any) -> ProbeSpec:
    return ProbeSpec(probe_id=probe_id, kernel="builtin", condition=condition, shape=SHAPE, **kwargs)


def ok(probe_id: str, **kwargs: Any) -> ProbeSpec:
    return spec(probe_id, Condition.SELFTEST_OK, **kwargs)


def raising(probe_id: str, error_type: str, message: str) -> ProbeSpec:
    return spec(probe_id, Condition.SELFTEST_RAISE, params={"type": error_type, "message": message})


def session(specs: list[ProbeSpec], tmp_path: Path, **kwargs: Any) -> list[Outcome]:
    kwargs.setdefault("base_env", {})
    outcomes = run_session(specs, log_dir=tmp_path / "logs", **kwargs)
    assert [o.probe_id for o in outcomes] == [s.probe_id for s in specs]
    return outcomes


def pid_of(outcome: Outcome) -> int:
    return int(outcome.facts["worker.pid"])


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
        return state in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # pragma: no cover - no /proc
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def wait_gone(pid: int, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.05)
    return process_gone(pid)


def fake_python(tmp_path: Path, body: str) -> tuple[Path, Path]:
    """An executable standing in for a Python interpreter; counts its starts in a file."""
    counter = tmp_path / "starts"
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\necho start >> '{counter}'\n{textwrap.dedent(body)}")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, counter


def starts(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


# --- sessions ---


def test_mixed_session_parent_survives_every_failure(tmp_path: Path) -> None:
    specs = [
        ok("ok-1", params={"stdout_noise": True}),
        raising("illegal", "torch.AcceleratorError", ILLEGAL),
        ok("ok-2"),
        spec("segv", Condition.SELFTEST_SEGFAULT),
        ok("ok-3"),
        spec("exit", Condition.SELFTEST_EXIT, params={"code": 3, "message": f"RuntimeError: {ILLEGAL}"}),
        spec("kill-segv", Condition.SELFTEST_SEGFAULT, params={"how": "kill"}),
        spec("sys-exit", Condition.SELFTEST_EXIT, params={"code": 4, "how": "sys.exit"}),
        ok("ok-4"),
    ]
    out = {o.probe_id: o for o in session(specs, tmp_path)}

    assert out["ok-1"].status is Status.PASS and out["ok-1"].phase is Phase.DONE
    assert out["ok-1"].notes == ("self-test: ok",)  # protocol-looking noise on stdout did no harm

    illegal = out["illegal"]
    assert illegal.status is Status.ERROR
    assert illegal.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert illegal.error_type == "torch.AcceleratorError"
    assert illegal.error_message == ILLEGAL
    assert illegal.phase is Phase.LAUNCH
    assert "Traceback" in illegal.stderr_tail and ILLEGAL in illegal.stderr_tail
    assert illegal.facts["pid"] == pid_of(out["ok-1"])  # ran in the warm worker...
    assert pid_of(out["ok-2"]) != pid_of(out["ok-1"])  # ...which was replaced after it

    segv = out["segv"]
    assert (segv.status, segv.error_kind, segv.error_type) == (Status.ERROR, ErrorKind.SIGNAL, "signal")
    assert segv.exit_code == -11 and segv.phase is Phase.LAUNCH
    assert "Segmentation fault" in segv.stderr_tail  # faulthandler's report, from the log
    assert "SIGSEGV" in (segv.error_message or "")
    assert pid_of(segv) == pid_of(out["ok-2"]) != pid_of(out["ok-3"])

    exited = out["exit"]
    assert exited.error_kind is ErrorKind.ILLEGAL_ADDRESS  # classified from the child's stderr
    assert (exited.exit_code, exited.error_type, exited.phase) == (3, "exit", Phase.LAUNCH)
    assert ILLEGAL in exited.stderr_tail

    assert out["kill-segv"].error_kind is ErrorKind.SIGNAL and out["kill-segv"].exit_code == -11

    sys_exit = out["sys-exit"]  # SystemExit is caught in the worker and reported, then it exits
    assert (sys_exit.error_kind, sys_exit.error_type) == (ErrorKind.OTHER, "SystemExit")
    assert "sys.exit(4)" in (sys_exit.error_message or "")
    assert out["ok-4"].status is Status.PASS
    assert pid_of(out["ok-4"]) != pid_of(sys_exit)
    assert len({pid_of(o) for o in out.values()}) == 6


def test_non_poisoning_errors_keep_the_worker(tmp_path: Path) -> None:
    specs = [
        ok("a"),
        raising("ptr", "ValueError", "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"),
        raising("oom", "torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB."),
        raising(
            "mismatch",
            "RuntimeError",
            "Expected all tensors to be on the same device, but found "
            "at least two devices, cuda:0 and cuda:1!",
        ),
        ok("b"),
    ]
    out = session(specs, tmp_path)
    assert [o.error_kind for o in out] == [
        None,
        ErrorKind.POINTER_INACCESSIBLE,
        ErrorKind.OOM,
        ErrorKind.DEVICE_MISMATCH,
        None,
    ]
    assert out[2].error_type == "torch.OutOfMemoryError"
    assert len({pid_of(o) for o in out}) == 1
    assert [o.facts["worker.probe_index"] for o in out] == [0, 1, 2, 3, 4]


def test_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    hang = spec(
        "hang",
        Condition.SELFTEST_HANG,
        timeout_s=3.0,  # the worker's start-up included: it is the worker's first probe
        params={"grandchild": True, "pid_file": str(pid_file)},
    )
    out = session([hang, ok("after")], tmp_path)

    timed_out = out[0]
    assert (timed_out.status, timed_out.error_kind, timed_out.error_type) == (
        Status.ERROR,
        ErrorKind.TIMEOUT,
        "timeout",
    )
    assert timed_out.phase is Phase.SYNC  # the last breadcrumb before the hang
    assert timed_out.wall_s >= 3.0  # counted from the request, the worker's start-up included
    assert "timed out at sync after 3 s" in (timed_out.error_message or "")
    assert "selftest.py" in timed_out.stderr_tail  # faulthandler's stack dump on SIGUSR1
    grandchild = int(pid_file.read_text())
    assert wait_gone(grandchild), "the grandchild survived the timeout kill"
    assert wait_gone(pid_of(timed_out))
    assert out[1].status is Status.PASS and pid_of(out[1]) != pid_of(timed_out)


def test_fresh_process_and_spec_env_get_their_own_worker(tmp_path: Path) -> None:
    names = ["QMOE_TEST_BASE", "QMOE_TEST_SPEC", "NCCL_NVLS_ENABLE", "PYTHONFAULTHANDLER"]
    specs = [
        ok("warm-1", params={"env_facts": names}),
        ok("fresh", fresh_process=True),
        ok("env", env={"QMOE_TEST_SPEC": "spec", "NCCL_NVLS_ENABLE": "1"}, params={"env_facts": names}),
        ok("warm-2"),
    ]
    out = session(specs, tmp_path, base_env={"QMOE_TEST_BASE": "base", "NCCL_NVLS_ENABLE": "1"})
    assert all(o.status is Status.PASS for o in out)
    warm1, fresh, env, warm2 = (pid_of(o) for o in out)
    assert warm1 == warm2
    assert len({warm1, fresh, env}) == 3
    assert out[1].facts["worker.probe_index"] == 0
    assert out[0].facts["env:QMOE_TEST_BASE"] == "base"
    assert out[0].facts["env:QMOE_TEST_SPEC"] is None
    assert out[2].facts["env:QMOE_TEST_SPEC"] == "spec"
    assert out[2].facts["env:QMOE_TEST_BASE"] == "base"
    for o in (out[0], out[2]):  # NVLink multicast stays off whatever base_env or the spec says
        assert o.facts["env:NCCL_NVLS_ENABLE"] == "0"
        assert o.facts["env:PYTHONFAULTHANDLER"] == "1"
    assert wait_gone(fresh) and wait_gone(env)  # own workers end after their spec


def test_events_report_progress(tmp_path: Path) -> None:
    events: list[Event] = []
    session([ok("a"), raising("b", "RuntimeError", ILLEGAL), ok("c")], tmp_path, on_event=events.append)
    kinds = [(e.kind, e.probe_id, e.phase) for e in events]
    assert kinds[:6] == [
        (EventKind.WORKER_STARTED, None, None),
        (EventKind.PROBE_STARTED, "a", None),
        (EventKind.CRUMB, "a", Phase.SETUP),
        (EventKind.CRUMB, "a", Phase.LAUNCH),
        (EventKind.CRUMB, "a", Phase.COMPARE),
        (EventKind.OUTCOME, "a", Phase.DONE),
    ]
    restarted = [e for e in events if e.kind is EventKind.WORKER_RESTARTED]
    assert len(restarted) == 1 and "illegal-address" in restarted[0].detail and restarted[0].worker == 2
    outcomes = [e.outcome for e in events if e.kind is EventKind.OUTCOME]
    assert [o.probe_id for o in outcomes if o is not None] == ["a", "b", "c"]


def test_logs_are_kept_per_worker(tmp_path: Path) -> None:
    session([ok("a", params={"stdout_noise": True}), ok("b", fresh_process=True)], tmp_path)
    logs = sorted((tmp_path / "logs").glob("worker-*.log"))
    assert [p.name for p in logs] == ["worker-001.log", "worker-002.log"]
    assert '"probe_id":"noise"' in logs[0].read_text()  # the noise went to the log
    assert logs[1].read_text().startswith("# qmoe-doctor worker 2 (fresh process for b)")


def test_sessions_sharing_a_log_dir_do_not_overwrite_logs(tmp_path: Path) -> None:
    first = session([ok("a")], tmp_path)
    second = session([ok("b")], tmp_path)
    assert (first[0].facts["worker.index"], second[0].facts["worker.index"]) == (1, 2)
    logs = sorted(p.name for p in (tmp_path / "logs").glob("worker-*.log"))
    assert logs == ["worker-001.log", "worker-002.log"]


def test_unreadable_spec_is_a_protocol_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import qmoe_doctor.isolate.worker_pool as isolate

    monkeypatch.setattr(isolate, "to_json", lambda _spec: '{"probe_id": "a", "condition": "no-such"}')
    (outcome,) = session([ok("a")], tmp_path)
    assert (outcome.error_kind, outcome.error_type) == (ErrorKind.OTHER, "protocol")
    assert "cannot read the spec" in (outcome.error_message or "")


def test_run_one(tmp_path: Path) -> None:
    outcome = run_one(ok("solo"), log_dir=tmp_path)
    assert outcome.status is Status.PASS and outcome.facts["worker.index"] == 1


# --- children that cannot start ---


def test_missing_python_binary(tmp_path: Path) -> None:
    events: list[Event] = []
    out = session(
        [ok("a"), ok("b")], tmp_path, python=str(tmp_path / "no-such-python"), on_event=events.append
    )
    assert sum(e.kind is EventKind.WORKER_FAILED for e in events) == 2  # a, and its one retry
    for o in out:
        assert (o.status, o.phase, o.error_kind, o.error_type) == (
            Status.ERROR,
            Phase.SPAWN,
            ErrorKind.OTHER,
            "spawn",
        )
        assert "cannot start" in (o.error_message or "")


def test_python_dying_before_ready_is_not_respawned_forever(tmp_path: Path) -> None:
    python, counter = fake_python(tmp_path, "echo 'broken interpreter' >&2\nexit 7\n")
    events: list[Event] = []
    out = session(
        [ok("a"), ok("b"), ok("c", fresh_process=True)], tmp_path, python=str(python), on_event=events.append
    )
    for o in out:
        assert (o.status, o.phase, o.error_kind) == (Status.ERROR, Phase.SPAWN, ErrorKind.OTHER)
        assert o.exit_code == 7
        assert "broken interpreter" in o.stderr_tail
        assert "exited with status 7 before it was ready" in (o.error_message or "")
    assert starts(counter) == 2  # one try and one retry; the same environment is not tried again
    assert sum(e.kind is EventKind.WORKER_FAILED for e in events) == 2


def test_python_without_qmoe_doctor_gets_a_hint(tmp_path: Path) -> None:
    python, _ = fake_python(
        tmp_path,
        'echo "/usr/bin/python3: Error while finding module specification for '
        "'qmoe_doctor.probes.worker' (ModuleNotFoundError: No module named 'qmoe_doctor')\" >&2\nexit 1\n",
    )
    (outcome,) = session([ok("a")], tmp_path, python=str(python))
    assert "install qmoe-doctor" in (outcome.error_message or "")


def test_python_hanging_before_ready(tmp_path: Path) -> None:
    """A child that never says ready uses the probe's own timeout (no hidden start-up allowance),
    is not started again in the same environment, and the message says where it hung."""
    python, counter = fake_python(tmp_path, "exec sleep 60\n")
    out = session([ok("a", timeout_s=0.5), ok("b", timeout_s=0.5)], tmp_path, python=str(python))
    for outcome in out:
        assert (outcome.phase, outcome.error_kind, outcome.error_type) == (
            Phase.SPAWN,
            ErrorKind.TIMEOUT,
            "spawn",
        )
        assert "timed out at spawn after 0.5 s: it never said it was ready" in (outcome.error_message or "")
    assert starts(counter) == 1


def test_one_retry_rescues_a_flaky_start(tmp_path: Path) -> None:
    python, counter = fake_python(
        tmp_path, f"[ $(wc -l < '{tmp_path / 'starts'}') -ge 2 ] || exit 1\nexec '{sys.executable}' \"$@\"\n"
    )
    (outcome,) = session([ok("a")], tmp_path, python=str(python))
    assert outcome.status is Status.PASS
    assert starts(counter) == 2


def test_child_python_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(knobs.QMOE_CHILD_PYTHON, raising=False)
    assert child_python() == sys.executable
    monkeypatch.setenv(knobs.QMOE_CHILD_PYTHON, "/opt/venv/bin/python")
    assert child_python() == "/opt/venv/bin/python"
    assert child_python("/x/python") == "/x/python"


def test_child_env_forces_nvls_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    env = child_env({"NCCL_NVLS_ENABLE": "1", "A": "base"}, {"A": "spec", "NVSHMEM_DISABLE_NVLS": "0"})
    assert env["A"] == "spec"
    for name, value in knobs.NVLS_OFF.items():
        assert env[name] == value
    assert env["PYTHONUNBUFFERED"] == "1" and env["PYTHONFAULTHANDLER"] == "1"


def test_parent_never_imports_torch() -> None:
    code = (
        "import sys, qmoe_doctor.isolate.worker_pool, qmoe_doctor.isolate.torchrun, "
        "qmoe_doctor.isolate.one_shot, qmoe_doctor.isolate.logs, qmoe_doctor.core.error_kind\n"
        "sys.exit('torch' in sys.modules or 'triton' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- the worker in this process (no child): how run_probe's result becomes an Outcome ---


@pytest.fixture
def fake_conditions(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    module = types.SimpleNamespace(run_probe=None)
    monkeypatch.setitem(sys.modules, "qmoe_doctor.probes.conditions", module)
    monkeypatch.setattr(qmoe_doctor.probes, "conditions", module, raising=False)
    return module


def test_worker_assembles_the_outcome(fake_conditions: types.SimpleNamespace) -> None:
    def run_probe(ctx: ProbeContext) -> dict[str, Any]:
        ctx.crumb(Phase.SETUP)
        ctx.fact("peer_access", True)
        ctx.note("x on cuda:1")
        ctx.crumb(Phase.COMPARE)
        return {"status": "wrong", "rel_error": 0.5, "tolerance": 1e-2, "canary_hits": ["after y"]}

    fake_conditions.run_probe = run_probe
    messages: list[dict[str, Any]] = []
    outcome, poisoned = execute(spec("p", Condition.PEER, device=1, current=0), messages.append)
    assert not poisoned
    assert (outcome.status, outcome.phase, outcome.rel_error) == (Status.WRONG, Phase.DONE, 0.5)
    assert outcome.canary_hits == ("after y",)
    assert outcome.facts == {"peer_access": True} and outcome.notes == ("x on cuda:1",)
    assert [m["phase"] for m in messages] == ["import", "setup", "compare"]


def test_worker_reports_kernel_import_failure(fake_conditions: types.SimpleNamespace) -> None:
    def run_probe(ctx: ProbeContext) -> dict[str, Any]:
        raise ModuleNotFoundError("No module named 'my_moe'")

    fake_conditions.run_probe = run_probe
    outcome, poisoned = execute(spec("p", Condition.SINGLE, device=0))
    assert (outcome.error_kind, outcome.phase, poisoned) == (ErrorKind.KERNEL_IMPORT, Phase.IMPORT, False)


def test_worker_rejects_fields_it_owns(fake_conditions: types.SimpleNamespace) -> None:
    fake_conditions.run_probe = lambda ctx: {"status": "pass", "probe_id": "other"}
    outcome, poisoned = execute(spec("p", Condition.SINGLE, device=0))
    assert outcome.status is Status.ERROR and outcome.error_kind is ErrorKind.OTHER and poisoned
    assert "probe_id" in (outcome.error_message or "")


def test_context_add_tensor_and_facts() -> None:
    class FakeTensor:
        device = "cuda:1"
        dtype = "torch.bfloat16"
        shape = (4, 3)

        def data_ptr(self) -> int:
            return 0x7F0000001000

        def numel(self) -> int:
            return 12

        def element_size(self) -> int:
            return 2

        def stride(self) -> tuple[int, int]:
            return (1, 4)

    class Scalar:
        def item(self) -> float:
            return 1.5

    ctx = ProbeContext(ok("t"))
    assert ctx.phase is Phase.SPAWN
    info = ctx.add_tensor("x", FakeTensor())
    assert (info.device, info.data_ptr, info.nbytes, info.shape, info.strides, info.dtype) == (
        "cuda:1",
        0x7F0000001000,
        24,
        (4, 3),
        (1, 4),
        "bfloat16",
    )
    ctx.fact("scalar", Scalar())
    ctx.fact("shape", (4, 3))
    ctx.fact("obj", object)
    assert ctx.facts["scalar"] == 1.5 and ctx.facts["shape"] == [4, 3]
    assert ctx.facts["obj"] == "<class 'object'>"
    assert ctx.tensors == (info,)


def worker_by_hand() -> tuple[subprocess.Popen[bytes], int]:
    """A probe worker started as the parent starts one, less the parent-death signal: the worker
    and the read end of its protocol pipe."""
    read_fd, write_fd = os.pipe()
    worker = subprocess.Popen(
        [sys.executable, "-m", "qmoe_doctor.probes.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, knobs.QMOE_RESULT_FD: str(write_fd)},
        pass_fds=(write_fd,),
        start_new_session=True,
    )
    os.close(write_fd)
    return worker, read_fd


def test_worker_kills_its_group_when_the_parent_goes_mid_probe(tmp_path: Path) -> None:
    """The pipe watchdog alone (this worker is started without the parent-death signal): the spec
    pipe closes while a probe hangs, as when the parent is SIGKILLed, and the worker kills its own
    process group, the probe's grandchild included."""
    pid_file = tmp_path / "grandchild.pid"
    worker, read_fd = worker_by_hand()
    try:
        hang = spec("hang", Condition.SELFTEST_HANG, params={"grandchild": True, "pid_file": str(pid_file)})
        assert worker.stdin is not None
        worker.stdin.write((to_json(hang) + "\n").encode())
        worker.stdin.flush()
        deadline = time.monotonic() + 30
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int(pid_file.read_text())
        worker.stdin.close()  # the parent's end of the spec pipe, gone mid-probe
        assert worker.wait(timeout=10) == -9
        assert wait_gone(grandchild)
    finally:
        os.close(read_fd)
        if worker.poll() is None:
            os.killpg(worker.pid, 9)
            worker.wait()


def test_worker_exits_quietly_when_the_pipe_closes_between_probes(tmp_path: Path) -> None:
    worker, read_fd = worker_by_hand()
    try:
        with os.fdopen(read_fd, "rb") as results:
            assert json.loads(results.readline())["type"] == "ready"
            assert worker.stdin is not None
            worker.stdin.write((to_json(ok("a")) + "\n").encode())
            worker.stdin.flush()
            while json.loads(results.readline())["type"] != "outcome":
                pass
            worker.stdin.close()
            assert worker.wait(timeout=10) == 0
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, 9)
            worker.wait()
