"""`qmoe-doctor bench` on the CPU: the --tiny run end to end (a real child, the Triton
interpreter), usage and exit codes, the report's JSON contract, the renderer and the plot.

Nothing here times anything or asserts a speed: --tiny claims none, and the plot and table tests
draw the numbers recorded on 2x H200 (2026-11-22, commit ab67830).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.render.bench import render_report
from qmoe_doctor.core import knobs
from qmoe_doctor.core.bench import (
    BLOCK_IMPLS,
    BLOCK_OPS,
    BLOCK_QMOE_GRAPH,
    DEFAULT_TOKENS,
    DENSE,
    GEMM_IMPLS,
    GEMM_OPS,
    GRAPH_IMPLS,
    QMOE,
    BenchReport,
    BenchRow,
    PlacementRow,
    default_tokens,
    parse_tokens,
    report_document,
    report_from_jsonable,
    with_fractions,
    with_slowdowns,
)
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.machine.inventory import GpuInfo, Inventory
from qmoe_doctor.workflows.bench import load_report

runner = CliRunner()
BENCH_2XH200 = Path(__file__).resolve().parents[1] / "fixtures" / "reports" / "bench" / "2026-11-22-2xh200-ab67830" / "bench.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # a dev box with a GPU still tests the CPU tier; the child inherits this
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _inventory(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    """Make the command see ``gpus`` fake GPUs (NVML is not asked)."""
    inv = Inventory(
        gpus=tuple(
            GpuInfo(index=i, name="NVIDIA H200", uuid=f"GPU-{i:08d}", pci_bus_id=f"00000000:{i:02x}:00.0")
            for i in range(gpus)
        ),
        nvml_error=None if gpus else "NVML Shared Library Not Found",
    )
    monkeypatch.setattr("qmoe_doctor.cli.devices.collect_inventory", lambda: inv)


# --------------------------------------------------------------------------------------------
# The CPU smoke run, end to end
# --------------------------------------------------------------------------------------------


def test_bench_tiny_json_runs_every_row_in_a_child(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "--tiny", "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "bench" and doc["schema_version"] == 1
    assert doc["timed"] is False and doc["interpreter"] is True
    assert doc["preset"] == "tiny" and doc["tokens"] == list(DEFAULT_TOKENS["tiny"])
    assert doc["placement"] == [] and doc["gpus"] == []
    rows = {(r["op"], r["impl"], r["tokens"]): r for r in doc["rows"]}
    for tokens in DEFAULT_TOKENS["tiny"]:
        for op in GEMM_OPS:
            for impl in GEMM_IMPLS:
                assert (op, impl, tokens) in rows, (op, impl, tokens)
        for op in BLOCK_OPS:
            for impl in BLOCK_IMPLS:
                assert (op, impl, tokens) in rows, (op, impl, tokens)
    assert all(r["ms"] is None and r["tflops"] is None and r["frac_dense"] is None for r in doc["rows"])
    assert not [r for r in doc["rows"] if r["note"]], [r["note"] for r in doc["rows"] if r["note"]]
    tol = tolerance(doc["dtype"])
    for r in doc["rows"]:
        if r["op"] != "block-forward-backward" and r["impl"] != DENSE:
            assert r["rel_err"] is not None and r["rel_err"] < tol, r
        assert r["m"] == r["tokens"] * doc["shape"]["top_k"]
    # the files under --out: the same document, the child's log, no plot for an untimed run
    assert doc["files"] == {
        "json": str(tmp_path / "bench.json"),
        "plot": None,
        "log": str(tmp_path / "bench.log"),
    }
    assert json.loads((tmp_path / "bench.json").read_text()) == doc
    assert "T=" in (tmp_path / "bench.log").read_text()
    assert not (tmp_path / ".bench-child.json").exists()
    assert "--tiny" in doc["command"]


def test_bench_tiny_table_says_nothing_is_timed(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "--tiny", "--tokens", "8", "--no-block", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "nothing timed, no speed claims" in result.stdout
    assert "MoE block" not in result.stdout and "block fwd" not in result.stdout
    assert "ran" in result.stdout


def test_bench_tiny_balanced_routing_is_recorded_and_said(tmp_path: Path) -> None:
    """--routing balanced reaches the child (every expert M/E rows in the GEMM rows), the report
    records it, the table's header says it and the recorded command repeats it."""
    args = ["bench", "--tiny", "--tokens", "8", "--no-block", "--routing", "balanced", "--out", str(tmp_path)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["routing"] == "balanced" and "--routing balanced" in doc["command"]
    assert {r["op"] for r in doc["rows"]} == {"forward", "dx", "dw"}
    assert all(r["rel_err"] is None or r["rel_err"] < 1e-3 for r in doc["rows"]), doc["rows"]
    table = runner.invoke(app, args)
    assert table.exit_code == 0 and "routed balanced" in " ".join(table.stdout.split())


def test_bench_routings_route_every_row() -> None:
    """The child's routings: balanced is M // E per expert plus one for the first M % E; random
    is a top-k of uniform scores (top_k distinct experts per token, so M rows in all)."""
    import torch

    from qmoe_doctor.probes.bench import routing_sizes

    gen = torch.Generator().manual_seed(1)
    cpu = torch.device("cpu")
    flat = routing_sizes(100, 6, 4, gen, cpu, "balanced")
    assert flat.tolist() == [67, 67, 67, 67, 66, 66] and int(flat.sum()) == 400
    rand = routing_sizes(100, 6, 4, gen, cpu, "random")
    assert int(rand.sum()) == 400 and rand.tolist() != flat.tolist()
    # the issue's point (tools/profile/routing_probe.py measures both): 128 rows each, or ~128 +- 11
    assert routing_sizes(2048, 128, 8, gen, cpu, "balanced").unique().tolist() == [128]
    spread = routing_sizes(2048, 128, 8, gen, cpu, "random")
    assert int(spread.sum()) == 16384 and int(spread.max() - spread.min()) > 16
    with pytest.raises(ValueError, match="routing 'skewed'"):
        routing_sizes(100, 6, 4, gen, cpu, "skewed")


# --------------------------------------------------------------------------------------------
# Usage, GPUs and a failing child: exit codes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--preset", "nope"], "unknown preset"),
        (["--tiny", "--tokens", "0"], "positive"),
        (["--tiny", "--tokens", "a,b"], "positive"),
        (["--tiny", "--tokens", ","], "names no token count"),
        (["--tiny", "--tokens", "100000"], "at most"),
        (["--tiny", "--dtype", "fp8"], "bf16, fp16 or fp32"),
        (["--tiny", "--routing", "skewed"], "random or balanced"),
        (["--tiny", "--gpus", "0"], "--tiny runs on the CPU"),
        (["--tiny", "--placement"], "--tiny runs on the CPU"),
    ],
)
def test_bench_usage_errors_exit_2(tmp_path: Path, args: list[str], says: str) -> None:
    result = runner.invoke(app, ["bench", *args, "--out", str(tmp_path)])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert says in " ".join(result.output.split())  # rich may wrap the message


def test_bench_unknown_gpu_is_a_usage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _inventory(monkeypatch, gpus=2)
    result = runner.invoke(app, ["bench", "--gpus", "7", "--out", str(tmp_path)])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "no GPU 7" in result.output


def test_bench_gpus_given_on_a_machine_without_gpus_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inventory(monkeypatch, gpus=0)
    result = runner.invoke(app, ["bench", "--gpus", "0", "--out", str(tmp_path)])
    assert result.exit_code == ExitCode.USAGE, result.output


def test_bench_without_a_gpu_says_use_tiny_and_exits_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inventory(monkeypatch, gpus=0)
    result = runner.invoke(app, ["bench", "--out", str(tmp_path)])
    assert result.exit_code == ExitCode.TOO_FEW_GPUS, result.output
    text = " ".join(result.output.split())
    assert "no GPU found" in text and "qmoe-doctor bench --tiny" in text
    assert not (tmp_path / "bench.json").exists()


def test_bench_placement_on_one_gpu_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _inventory(monkeypatch, gpus=1)
    result = runner.invoke(app, ["bench", "--placement", "--out", str(tmp_path)])
    assert result.exit_code == ExitCode.TOO_FEW_GPUS, result.output
    assert "--placement needs 2 GPUs" in " ".join(result.output.split())


def _fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "fake-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_bench_child_that_dies_exits_4_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(
        knobs.QMOE_CHILD_PYTHON, _fake_python(tmp_path, "echo 'boom: no CUDA here' >&2; exit 7")
    )
    out = tmp_path / "out"
    result = runner.invoke(app, ["bench", "--tiny", "--out", str(out)])
    assert result.exit_code == ExitCode.CHECK_BROKEN, result.output
    assert "exited with status 7" in result.output and "boom: no CUDA here" in result.output
    assert "boom: no CUDA here" in (out / "bench.log").read_text()


def test_bench_child_that_hangs_is_killed_at_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(knobs.QMOE_CHILD_PYTHON, _fake_python(tmp_path, "echo started; exec sleep 60"))
    start = time.monotonic()
    result = runner.invoke(app, ["bench", "--tiny", "--timeout", "1", "--out", str(tmp_path / "out")])
    assert result.exit_code == ExitCode.CHECK_BROKEN, result.output
    assert time.monotonic() - start < 20
    assert "did not finish in 1 s" in result.output


def test_bench_child_that_writes_no_report_exits_4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(knobs.QMOE_CHILD_PYTHON, _fake_python(tmp_path, "exit 0"))
    result = runner.invoke(app, ["bench", "--tiny", "--out", str(tmp_path / "out")])
    assert result.exit_code == ExitCode.CHECK_BROKEN, result.output
    assert "no readable report" in result.output


def _recorded_child(tmp_path: Path) -> str:
    """A child interpreter that measures nothing and writes the recorded 2x H200 report where asked: the
    parent's timed path (table, JSON, plot) without a GPU."""
    path = tmp_path / "recorded-child"
    path.write_text(
        f"#!{sys.executable}\n"
        "import json, shutil, sys\n"
        "request = json.loads(sys.argv[-1])\n"
        "print('T=2048 forward qmoe', file=sys.stderr)\n"
        f"shutil.copy({str(BENCH_2XH200)!r}, request['result_path'])\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_bench_timed_report_table_json_and_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _inventory(monkeypatch, gpus=2)
    monkeypatch.setenv(knobs.QMOE_CHILD_PYTHON, _recorded_child(tmp_path))
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["bench", "--gpus", "1", "--tokens", "2048", "--out", str(out)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "326.5 46%" in result.stdout and "(GPU 1)" in result.stdout
    doc = json.loads((out / "bench.json").read_text())
    assert doc["kind"] == "bench" and doc["gpus"] == [1] and doc["timed"] is True
    assert doc["command"] == "qmoe-doctor bench --preset qwen3-30b-a3b --tokens 2048 --gpus 1 --dtype bf16"
    if importlib.util.find_spec("matplotlib") is None:
        assert doc["files"]["plot"] is None and "matplotlib is not installed" in result.output
    else:
        assert doc["files"]["plot"] == str(out / "bench.png")
        assert (out / "bench.png").read_bytes().startswith(PNG_MAGIC)


def test_bench_without_matplotlib_says_so_and_still_writes_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _inventory(monkeypatch, gpus=1)
    monkeypatch.setenv(knobs.QMOE_CHILD_PYTHON, _recorded_child(tmp_path))
    # the command's own name for it (imported by name): patching only reports.plot's passed only
    # where matplotlib really was missing
    monkeypatch.setattr("qmoe_doctor.cli.commands.bench.plot_available", lambda: False)
    out = tmp_path / "out"
    result = runner.invoke(app, ["bench", "--json", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "matplotlib is not installed" in " ".join(result.output.split())
    doc = json.loads(result.stdout)
    assert doc["files"]["plot"] is None and not (out / "bench.png").exists()
    assert json.loads((out / "bench.json").read_text()) == doc


def test_bench_help_documents_the_exit_codes() -> None:
    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "3 too few GPUs" in text and "4 the benchmark child failed" in text and "--tiny" in text


# --------------------------------------------------------------------------------------------
# The report: tokens, fractions, slowdowns, JSON, the run-3 format, the table
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [("2048", (2048,)), ("512, 128,2048", (128, 512, 2048)), ("128,128", (128,)), ("64,", (64,))],
)
def test_parse_tokens(text: str, want: tuple[int, ...]) -> None:
    assert parse_tokens(text) == want


@pytest.mark.parametrize("text", ["", "0", "-4", "1.5", "x", " , "])
def test_parse_tokens_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_tokens(text)


def test_default_tokens_cover_issue_8s_shape_and_every_preset() -> None:
    from qmoe_doctor.core.shapes import PRESETS

    assert 2048 * PRESETS["qwen3-30b-a3b"].top_k == 16384
    assert 2048 in default_tokens("qwen3-30b-a3b")
    for name in PRESETS:
        assert default_tokens(name)
    assert default_tokens("qwen3-30b-a3b", tiny=True) == DEFAULT_TOKENS["tiny"]


def test_recorded_2xh200_report_reads_as_one_token_count() -> None:
    report = load_report(BENCH_2XH200)
    assert report.timed and report.device == "NVIDIA H200" and report.tokens == (2048,)
    fwd = report.row("forward", QMOE, 2048)
    dense = report.row("forward", DENSE, 2048)
    assert fwd is not None and dense is not None and fwd.m == 16384
    assert fwd.tflops is not None and dense.tflops is not None
    assert fwd.frac_dense == pytest.approx(fwd.tflops / dense.tflops)
    assert fwd.frac_dense == pytest.approx(0.46, abs=0.01)  # docs/validation/kernels.md: 326.5 of 707.5
    assert report.ops() == ["forward", "dx", "dw", "block-forward", "block-forward-backward"]


def _multi_token_report() -> BenchReport:
    """The recorded 2x H200 report's rows repeated over four token counts (scaled), with placement rows: a report
    of the shape a GPU run writes, for the JSON, table and plot tests."""
    base = load_report(BENCH_2XH200)
    rows: list[BenchRow] = []
    placement: list[PlacementRow] = []
    for tokens, scale in ((128, 0.3), (512, 0.6), (2048, 1.0), (8192, 1.1)):
        for r in base.rows:
            if r.tflops is not None and r.ms is not None:
                rows.append(
                    dataclasses.replace(
                        r, tokens=tokens, m=tokens * 8, tflops=r.tflops * scale, ms=r.ms / scale
                    )
                )
        for name, kernel, ms in (
            ("local", "builtin", 0.30),
            ("guarded", "builtin", 0.31),
            ("remote", "specimen:unguarded", 3.6),
        ):
            placement.append(
                PlacementRow(
                    placement=name,  # type: ignore[arg-type]
                    kernel=kernel,
                    tokens=tokens,
                    m=tokens * 8,
                    current=1 if name == "local" else 0,
                    device=1,
                    peer_enabled=name == "remote",
                    ms=ms * tokens / 2048,
                    ms_scan=ms * tokens / 2048 + 0.02,
                    tflops=100.0 / ms,
                    rel_err=1.7e-3,
                )
            )
    return dataclasses.replace(
        base,
        tokens=(128, 512, 2048, 8192),
        gpus=(0, 1),
        rows=with_fractions(rows),
        placement=with_slowdowns(placement),
        notes=(),
        command="qmoe-doctor bench --gpus 0,1 --placement",
    )


def test_slowdowns_are_against_the_guarded_row_of_the_same_tokens() -> None:
    report = _multi_token_report()
    remote = [p for p in report.placement if p.placement == "remote"]
    assert all(p.slowdown == pytest.approx(3.6 / 0.31) for p in remote)
    guarded = [p for p in report.placement if p.placement == "guarded"]
    assert all(p.slowdown == pytest.approx(1.0) and p.slowdown_scan == pytest.approx(1.0) for p in guarded)
    big = next(p for p in remote if p.tokens == 8192)
    assert big.slowdown_scan == pytest.approx((3.6 * 4 + 0.02) / (0.31 * 4 + 0.02))


def test_report_round_trips_through_its_json_document() -> None:
    report = _multi_token_report()
    doc = json.loads(json.dumps(report_document(report, {"json": "x.json", "plot": None, "log": "x.log"})))
    assert doc["kind"] == "bench" and doc["schema_version"] == 1 and doc["files"]["plot"] is None
    assert report_from_jsonable(doc) == report


def test_table_shows_tflops_fraction_of_dense_and_slowdowns() -> None:
    console = Console(record=True, width=200)
    render_report(console, load_report(BENCH_2XH200))
    text = console.export_text()
    assert "326.5 46%" in text and "279.3 39%" in text and "707.5" in text
    assert "M=16384" in text and "NVIDIA H200" in text
    console = Console(record=True, width=200)
    render_report(console, _multi_token_report())
    text = console.export_text()
    assert "M=65536" in text and "11.6x" in text and "GPU 1" in text
    assert "'slow' at 3.0x" in text


BENCH = Path(__file__).resolve().parents[1] / "fixtures" / "reports" / "bench"


def test_recorded_graph_rows_and_routing_render() -> None:
    """The H200 report of commit 34deb04 has the CUDA-graph block rows: they load, sit under the
    block forward beside the eager rows, and the renderer shows their numbers; commit 205a368's
    balanced report says its routing in the header, its random twin does not."""
    report = load_report(BENCH / "2026-11-22-h200-34deb04" / "bench.json")
    graphed = [r for r in report.rows if r.impl in GRAPH_IMPLS]
    assert {(r.op, r.tokens) for r in graphed} == {("block-forward", t) for t in (128, 512, 2048, 8192)} and len(graphed) == 8
    assert set(GRAPH_IMPLS) <= set(report.impls("block-forward"))
    console = Console(record=True, width=260)
    render_report(console, report)
    text = console.export_text()
    assert BLOCK_QMOE_GRAPH in text and "232.7" in text and "180.8" in text
    for name, says in (("bench-balanced.json", True), ("bench-random.json", False)):
        console = Console(record=True, width=200)
        render_report(console, load_report(BENCH / "2026-11-22-h200-205a368" / name))
        assert ("routed balanced" in console.export_text()) == says, name


# --------------------------------------------------------------------------------------------
# The plot (needs matplotlib: the 'plot' extra)
# --------------------------------------------------------------------------------------------


def test_plot_of_recorded_report_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the 'plot' extra (matplotlib) is not installed")
    from qmoe_doctor.reports.plot import write_plot

    out = write_plot(load_report(BENCH_2XH200), tmp_path / "sub" / "bench.png", targets={"forward": 450.0})
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000


def test_plot_of_token_counts_and_placement_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the 'plot' extra (matplotlib) is not installed")
    from qmoe_doctor.reports.plot import write_plot

    out = write_plot(_multi_token_report(), tmp_path / "multi.png")
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_plot_refuses_an_untimed_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the 'plot' extra (matplotlib) is not installed")
    from qmoe_doctor.reports.plot import write_plot

    untimed = dataclasses.replace(load_report(BENCH_2XH200), timed=False)
    with pytest.raises(RuntimeError, match="nothing to plot"):
        write_plot(untimed, tmp_path / "x.png")


def test_plot_tool_renders_the_docs_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the 'plot' extra (matplotlib) is not installed")
    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "perf.png"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "plot_bench.py"), str(BENCH_2XH200), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "MPLBACKEND": "Agg"},
    )
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_tuner_tiny_runs_every_path_and_writes_a_table(tmp_path: Path) -> None:
    """benchmarks/tune_kernels.py --tiny: every candidate (pointer, TMA, flattened) runs in the
    interpreter and is compared with its twin; nothing is timed, so the table stays empty."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "tune_kernels.py"), "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "tune.json").read_text())
    ours = [r for r in result["rows"] if r["impl"] == "qmoe"]
    assert {r["op"] for r in ours} == {"forward", "dx", "dw"}
    assert {r["path"] for r in ours} >= {"pointer", "tma", "tma+flat", "pointer+flat", "tma+resident"}
    assert all(r["rel_diff"] is not None and r["rel_diff"] < 1e-2 and not r["note"] for r in ours)
    assert json.loads((tmp_path / "configs.json").read_text())["entries"] == []  # nothing timed


def test_tuner_merge_keeps_what_was_not_measured_and_says_where_it_came_from() -> None:
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("tune_kernels", repo / "benchmarks" / "tune_kernels.py")
    assert spec and spec.loader
    tk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tk)
    old = {
        "tuned_on": {"date": "then"},
        "entries": [
            {"op": "forward", "point": "p", "tokens": 8, "config": "a"},
            {"op": "dw", "point": "p", "tokens": 8, "config": "old"},
            {"op": "dw", "point": "p", "tokens": 64, "config": "other-tokens"},
            {"op": "dw", "point": "q", "tokens": 8, "config": "other-shape"},
        ],
    }
    new = {"tuned_on": {"date": "now"}, "entries": [{"op": "dw", "point": "p", "tokens": 8, "config": "new"}]}
    merged = tk.merge_tables(new, old, {("dw", "p", 8)}, "old.json")
    assert [(e["op"], e["config"]) for e in merged["entries"]] == [
        ("forward", "a"),
        ("dw", "other-tokens"),
        ("dw", "other-shape"),
        ("dw", "new"),
    ]
    assert merged["tuned_on"] == {"date": "now"}
    assert merged["kept_from"] == {"table": "old.json", "ops": ["dw", "forward"], "entries": 3, "tuned_on": {"date": "then"}}
    # a point measured without a winner (every config failed) drops its old entry too
    assert [e["config"] for e in tk.merge_tables({"entries": []}, old, {("dw", "p", 8)}, "o")["entries"]] == [
        "a",
        "other-tokens",
        "other-shape",
    ]


@pytest.mark.parametrize("pinned", ["", "128x128x64-w4-s3-p2-tma-t32,128x256x64-w8-s4-tma-t32"])
def test_tuner_measures_each_point_s_incumbent_with_a_pinned_list_too(pinned: str) -> None:
    """The table a tune writes is never slower than today's where it measured: today's pick (the
    incumbent) is a candidate with the per-card set and with ``--configs`` alike."""
    import argparse
    import importlib.util

    repo = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("tune_kernels", repo / "benchmarks" / "tune_kernels.py")
    assert spec and spec.loader
    tk = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tk)
    today = "128x128x128-w8-s3-tma-flat"
    tk.incumbent = lambda *a, **k: today  # the device's table, as on a GPU
    args = argparse.Namespace(configs=pinned, tiny=False, set="card", top_k=8)
    names = tk.candidates(args, "forward", ("30b-down", 128, 2048, 768, 2048), None, None)
    assert names.count(today) == 1
    if pinned:
        assert names == [*pinned.split(","), today]


@pytest.mark.parametrize(
    "tool",
    ["kernel_regs.py", "ncu_target.py", "block_profile.py", "host_overhead.py", "routing_probe.py", "dw_store_rate.py"],
)
def test_gpu_diagnostic_tools_explain_themselves_without_a_gpu(tool: str) -> None:
    """The GPU tools (run on the device machine) import torch only in main():
    --help works anywhere and says what the tool measures."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(repo / "tools" / "profile" / tool), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout and len(done.stdout.splitlines()) > 3
