"""`qmoe-doctor scan` end to end on the CPU tier (real child processes, Triton interpreter)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app

runner = CliRunner()


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # no NVML on CI machines; make that explicit so a dev box with a GPU still tests the CPU tier
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_scan_builtin_cpu_tier_is_healthy(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["scan", "--cpu", "--save", str(out), "--log-dir", str(tmp_path / "logs")])
    assert result.exit_code == 0, result.output
    assert "healthy" in result.output
    report = json.loads(out.read_text())
    assert report["healthy"] is True and report["tier"] == "cpu"
    assert {o["spec"]["condition"] for o in report["outcomes"]} == {
        "interpreter-check", "repeat-call", "single", "over-routed", "negative-sizes", "offsets", "launch-config",
    }
    assert all(o["status"] == "pass" for o in report["outcomes"])


def test_scan_json_is_versioned(tmp_path: Path) -> None:
    result = runner.invoke(app, ["scan", "--cpu", "--json", "--only", "single", "--log-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "scan" and doc["schema_version"] == 1
    assert doc["diagnoses"] == []
    assert [o["spec"]["condition"] for o in doc["outcomes"]] == ["interpreter-check", "single"]


def test_scan_specimen_unmasked_rows_names_invalid_routing(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["scan", "--cpu", "--kernel", "specimen:unmasked_rows", "--only", "single,over-routed",
              "--json", "--log-dir", str(tmp_path)],
    )
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert [d["cause"] for d in doc["diagnoses"]] == ["invalid-routing"]
    (fault,) = doc["diagnoses"]  # the over-routed write past y: a fault, not hardening
    assert fault["severity"] == "fault" and doc["hardening"] == []
    assert any(e["probe_id"] == "CPU/over-routed" and "after y" in e["detail"] for e in fault["evidence"])


def test_scan_user_kernel_from_a_file(tmp_path: Path) -> None:
    src = tmp_path / "mykernel.py"
    src.write_text(
        "from qmoe_doctor.kernels import moe_grouped_gemm\n"
        "def fused(x, w, m_sizes):\n"
        "    return moe_grouped_gemm(x, w, m_sizes)\n"
    )
    result = runner.invoke(app, ["scan", "--cpu", "--kernel", f"{src}:fused", "--only", "single", "--log-dir", str(tmp_path / "l")])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--kernel", "nosuchfile.py:fn"], "does not exist"),
        (["--kernel", "specimen:nope"], "nope"),
        (["--kernel", "no_colon_here"], "module:function"),
        (["--only", "bogus"], "unknown condition"),
        (["--preset", "gpt5"], "unknown preset"),
        (["--configs", "128x128"], "launch config"),
        (["--autotune", "fastest"], "--autotune"),
        (["--pairs-at-once", "0"], "--pairs-at-once"),
    ],
)
def test_scan_bad_input_is_a_usage_error(args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["scan", "--cpu", *args])
    assert result.exit_code == 2
    assert needle in result.output


@pytest.mark.parametrize("policy", ["first", "cached", "full", "CACHED"])
def test_autotune_policy_reaches_every_spec_and_the_cached_one_a_cache_of_the_scan(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qmoe_doctor.cli.commands import scan as scan_cmd
    from qmoe_doctor.workflows import scan

    envs: list[dict[str, str]] = []

    def recording(specs: list[Any], *, base_env: dict[str, str], **kw: Any) -> list[Any]:
        envs.append(dict(base_env))
        return _passing(specs)

    monkeypatch.setattr(scan, "run_session", recording)
    plans = []
    monkeypatch.setattr(scan_cmd, "plan_scan", lambda *a, **k: plans.append(scan.plan_scan(*a, **k)) or plans[-1])
    logs = tmp_path / "logs"
    result = runner.invoke(app, ["scan", "--cpu", "--autotune", policy, "--only", "single", "--json", "--log-dir", str(logs)])
    assert result.exit_code == 0, result.output
    (plan,) = plans
    assert plan.autotune.value == policy.lower()
    doc = json.loads(result.stdout)
    assert {o["spec"]["params"]["autotune"] for o in doc["outcomes"]} == {policy.lower()}
    cached = policy.lower() == "cached"
    assert all(e.get("TRITON_CACHE_AUTOTUNING") == ("1" if cached else None) for e in envs)
    assert all(e.get("TRITON_CACHE_DIR") == (str(logs / "triton-cache") if cached else None) for e in envs)


def test_parallel_refuses_the_scan_only_options() -> None:
    for extra in (["--autotune", "full"], ["--pairs-at-once", "2"]):
        result = runner.invoke(app, ["scan", "--cpu", "--parallel", "dp", *extra])
        assert result.exit_code == 2 and extra[0] in result.output, result.output


def test_help_says_what_each_autotune_policy_costs_and_sees() -> None:
    for command in ("scan", "check"):
        text = " ".join(runner.invoke(app, [command, "--help"], terminal_width=200).output.split())
        assert "--autotune" in text and "first" in text and "cached" in text and "full" in text
    assert "repeat-call probe autotunes for real" in " ".join(
        runner.invoke(app, ["scan", "--help"], terminal_width=2000).output.replace("│", " ").split()
    )


def test_scan_kernel_that_fails_to_import_gets_a_paragraph_not_a_traceback(tmp_path: Path) -> None:
    src = tmp_path / "broken.py"
    src.write_text("import not_a_real_module_qmoe\n\ndef fn(x, w, m):\n    return x\n")
    result = runner.invoke(app, ["scan", "--cpu", "--kernel", f"{src}:fn", "--log-dir", str(tmp_path / "l")])
    assert result.exit_code == 2
    assert "could not be used" in result.output and "not_a_real_module_qmoe" in result.output
    assert "Traceback" not in result.output


def test_scan_kernel_with_wrong_signature(tmp_path: Path) -> None:
    src = tmp_path / "sig.py"
    src.write_text("def fn(x):\n    return x\n")
    result = runner.invoke(app, ["scan", "--cpu", "--kernel", f"{src}:fn", "--log-dir", str(tmp_path / "l")])
    assert result.exit_code == 2
    assert "fn(x, w, m_sizes)" in result.output


def test_gpus_without_gpus_is_a_usage_error() -> None:
    result = runner.invoke(app, ["scan", "--gpus", "0,1"])
    assert result.exit_code == 2
    assert "no GPU" in result.output


def test_version_and_help() -> None:
    assert runner.invoke(app, ["--version"]).output.startswith("qmoe-doctor ")
    help_text = runner.invoke(app, ["scan", "--help"]).output
    assert "--gpus" in help_text and "Exit codes" in help_text


def test_cpu_tier_with_a_broken_interpreter_is_skipped_not_blamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If our own trivial reference kernel fails on this machine's interpreter, every kernel
    cell is skipped with the reason and the scan exits 4 (it could not run), not 1."""
    shim = tmp_path / "shim"
    shim.mkdir()
    # a sitecustomize in the children breaks the reference kernel the way triton 3.6 + NumPy 2.x
    # does (scalar loop bounds that cannot become Python ints)
    (shim / "sitecustomize.py").write_text(
        "import qmoe_doctor.probes._reference_kernels as r\n"
        "class _Broken:\n"
        "    def __getitem__(self, grid):\n"
        "        def launch(*a, **k):\n"
        "            raise TypeError('only 0-dimensional arrays can be converted to Python scalars')\n"
        "        return launch\n"
        "r.count_loop_kernel = _Broken()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(shim))
    result = runner.invoke(app, ["scan", "--cpu", "--json", "--only", "single", "--log-dir", str(tmp_path / "l")])
    assert result.exit_code == 4, result.output
    doc = json.loads(result.stdout)
    statuses = {o["spec"]["condition"]: o["status"] for o in doc["outcomes"]}
    assert statuses == {"interpreter-check": "error", "single": "skipped"}
    assert doc["unexplained"] == [] and doc["diagnoses"] == []
    assert any("interpreter cannot run" in e for e in doc["explanations"])


def _two_session_plan():
    """The CPU tier's plan with its session split in two rounds (as a GPU plan has one session per
    pair, in rounds of pairs that share no GPU)."""
    import dataclasses

    from qmoe_doctor.plan.scan import ScanOptions, plan_scan

    plan = plan_scan("builtin", [], ScanOptions(conditions=("single", "repeat-call")))
    (only,) = plan.sessions
    specs = [s for s in only.specs if s.condition.value != "interpreter-check"]
    first = dataclasses.replace(only, label="first", specs=tuple(specs[:1]))
    second = dataclasses.replace(only, label="second", specs=tuple(specs[1:]), round=1)
    return dataclasses.replace(plan, sessions=(first, second))


def _passing(specs, **_):
    from qmoe_doctor.core.records import Outcome, Phase, Status

    return [Outcome(probe_id=s.probe_id, spec=s, status=Status.PASS, phase=Phase.DONE) for s in specs]


def test_run_scan_reports_progress_after_every_round_but_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report of everything so far after each round (complete: false, the sessions not run
    listed, never healthy), so that a scan stopped half-way leaves its finished sessions behind
    (8x H200, 2026-11-22: an eight-GPU scan stopped after 48 of 56 pairs left nothing)."""
    from qmoe_doctor.workflows import scan

    monkeypatch.setattr(scan, "run_session", _passing)
    plan = _two_session_plan()
    seen = []
    final = scan.run_scan(plan, on_progress=seen.append)
    (partial,) = seen
    assert partial.complete is False and partial.not_run == ("second",) and not partial.healthy
    assert [o.probe_id for o in partial.outcomes] == [s.probe_id for s in plan.sessions[0].specs]
    assert scan.report_json(partial)["healthy"] is False
    assert final.complete and final.not_run == () and final.healthy
    assert len(final.outcomes) == sum(len(s.specs) for s in plan.sessions)


def test_interrupted_scan_keeps_the_report_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the first session: exit 130 (the shell's convention for SIGINT), and --save
    holds the first session's report, marked incomplete, written whole."""
    from qmoe_doctor.cli.commands import scan as scan_cmd
    from qmoe_doctor.workflows import scan

    monkeypatch.setattr(scan, "run_session", _passing)
    plan = _two_session_plan()
    monkeypatch.setattr(scan_cmd, "plan_scan", lambda *a, **k: plan)

    def stopped(p, *, on_progress=None, **kw):
        def interrupt(report):
            on_progress(report)
            raise KeyboardInterrupt

        return scan.run_scan(p, on_progress=interrupt, **kw)

    monkeypatch.setattr(scan_cmd, "run_scan", stopped)
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["scan", "--cpu", "--save", str(out), "--log-dir", str(tmp_path / "l")])
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.output and str(out) in result.output.replace("\n", "")
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and saved["not_run"] == ["second"] and saved["healthy"] is False
    assert len(saved["outcomes"]) == len(plan.sessions[0].specs)
    assert not list(tmp_path.glob("*.tmp"))


# --- worker logs: kept where asked, kept on failure and named, removed otherwise ------------------


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp dir of the test's own, where the scan's own log folder would go."""
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # gettempdir() caches its first answer
    return tmp


def test_healthy_scan_leaves_no_log_folder(temp_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["scan", "--cpu", "--only", "single", "--save", str(out)])
    assert result.exit_code == 0, result.output
    assert list(temp_dir.glob("qmoe-doctor-*")) == []
    assert json.loads(out.read_text())["log_dir"] == ""
    assert "logs:" not in result.output


def test_failing_scan_keeps_its_log_folder_and_says_where(temp_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "zeros.py"
    src.write_text("def fn(x, w, m_sizes):\n    return x.new_zeros(x.shape[0], w.shape[1])  # plainly wrong\n")
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["scan", "--cpu", "--kernel", f"{src}:fn", "--only", "single", "--save", str(out)])
    assert result.exit_code == 1, result.output
    (kept,) = temp_dir.glob("qmoe-doctor-*")
    assert json.loads(out.read_text())["log_dir"] == str(kept)
    assert any(kept.iterdir())  # the workers' logs
    assert f"logs:{kept}" in "".join(result.output.split())  # rich wraps the long path


def test_log_dir_asked_for_is_kept_when_healthy(temp_dir: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    result = runner.invoke(app, ["scan", "--cpu", "--only", "single", "--json", "--log-dir", str(logs)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["log_dir"] == str(logs) and any(logs.iterdir())
    assert list(temp_dir.glob("qmoe-doctor-*")) == []


@pytest.mark.parametrize("python", ["missing", "broken"])
def test_a_child_python_that_cannot_start_is_not_blamed_on_the_interpreter(
    python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QMOE_DOCTOR_CHILD_PYTHON naming no program, or one that dies at once: the phase is spawn,
    and neither the skip reason nor the note says the Triton interpreter cannot run."""
    from qmoe_doctor.core import knobs

    child = tmp_path / "python3"
    if python == "broken":
        child.write_text("#!/bin/sh\necho 'broken python' >&2\nexit 3\n")
        child.chmod(0o755)
    monkeypatch.setenv(knobs.QMOE_CHILD_PYTHON, str(child))
    result = runner.invoke(app, ["scan", "--cpu", "--json", "--only", "single", "--log-dir", str(tmp_path / "l")])
    assert result.exit_code == 4, result.output
    doc = json.loads(result.stdout)
    env_check, single = doc["outcomes"]
    assert env_check["phase"] == "spawn" and single["status"] == "skipped"
    assert single["notes"][0].startswith("no probe child could start: ")
    words = " ".join([*single["notes"], *doc["explanations"]])
    assert "interpreter cannot run" not in words and "no probe child could start" in words
