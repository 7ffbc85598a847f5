"""The packaged config tables against the sweeps that made them, recorded on the devices.

* ``tuning/2026-11-29-h200-5bcdcbc/tune.json.gz``: ``benchmarks/tune_kernels.py --set card
  --package`` on one H200 (``bash tools/gpu/perf_card.sh tune``; each point's finalists timed
  again in three interleaved rounds); its best table is the packaged
  ``kernels/configs-nvidia-h200-sm90-132sm.json``.
* ``tuning/2026-12-06-h100-395b650/tune.json.gz``: the same on one H100 80GB HBM3 (the previous
  H100 table's picks as the incumbents); its best table is the packaged
  ``kernels/configs-nvidia-h100-80gb-hbm3-sm90-132sm.json`` for forward and dx;
* ``tuning/2026-12-06-h100-4164575/tune.json.gz``: dw only on one H100 (``--ops dw --merge``, the
  per-card set with the warp-specialized ``-ws`` configs, the 395b650 table's dw picks as the
  incumbents); its best table is that packaged table's dw but at the four 480B points;
* ``tuning/2026-12-06-h100-521bdcd/tune.json.gz``: dw and dx at the four 480B points on one H100
  (``--ops dw,dx --shapes ... --merge``, the points the 4164575 sweep's deadline had left to their
  incumbents); its best table is the packaged table's dw and dx there;
* ``tuning/2026-12-06-h100-245e545/tune.json.gz``: forward and dx at five memory-bound points on one
  H100 (``--ops forward,dx --shapes ... --merge``, the per-card set with three tiles that keep more
  weight bytes in flight); its best table is the packaged table's forward and dx there;
* ``tuning/2026-12-06-h100-4f3513c/tune.json.gz``: dw at the eight 128- and 512-token points on
  one H100 (``--ops dw --shapes ... --merge``, the ws candidates with the deepest ring shared
  memory allows); its best table is the packaged table's dw there;
* ``tuning/2026-12-06-h100-c5ee87c/tune.json.gz``: forward and dx at the six 2048-token points on
  one H100 (``--configs`` five tail-kernel configs, each point's incumbent measured with them,
  ``--merge``); its best table is the packaged table's forward and dx there (the tail kernel at
  three forwards) but for the one entry the next sweep changed;
* ``tuning/2026-12-06-h100-00cb738/tune.json.gz``: the same six points with six configs of the
  flattened kernel with the tail (``-tma-flat-tN``), each point's incumbent measured with them;
  its best table is the packaged table's forward and dx there (one entry changed, dx 30B down).

``tests/fixtures/MANIFEST.md`` gives the machines, versions and commands.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from qmoe_doctor.kernels.tuning import config_from_name

REPO = Path(__file__).resolve().parents[2]
TUNING = REPO / "tests" / "fixtures" / "tuning"
#: per device, the sweeps behind its packaged table, in order: a later sweep's entries replace
#: the earlier ones' for the (op, point, tokens) it measured
SWEEPS = {
    "nvidia-h200-sm90-132sm": [TUNING / "2026-11-29-h200-5bcdcbc" / "tune.json.gz"],
    "nvidia-h100-80gb-hbm3-sm90-132sm": [
        TUNING / "2026-12-06-h100-395b650" / "tune.json.gz",
        TUNING / "2026-12-06-h100-4164575" / "tune.json.gz",
        TUNING / "2026-12-06-h100-521bdcd" / "tune.json.gz",
        TUNING / "2026-12-06-h100-245e545" / "tune.json.gz",
        TUNING / "2026-12-06-h100-4f3513c" / "tune.json.gz",
        TUNING / "2026-12-06-h100-c5ee87c" / "tune.json.gz",
        TUNING / "2026-12-06-h100-00cb738" / "tune.json.gz",
    ],
}
MAX_REL_DIFF = 2e-2  # tune_kernels.py's check against torch._grouped_mm before a config is timed


def _tune_kernels() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tune_kernels", REPO / "benchmarks" / "tune_kernels.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _key(e: dict[str, Any]) -> tuple[str, str, int]:
    return (e["op"], e["point"], e["tokens"])


def _sweeps(key: str) -> list[dict[str, Any]]:
    return [json.loads(gzip.decompress(path.read_bytes())) for path in SWEEPS[key]]


def _last_sweep_of_each_entry(key: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    """(op, point, tokens) -> the sweep that decides it (the last that measured it)."""
    deciding: dict[tuple[str, str, int], dict[str, Any]] = {}
    for sweep in _sweeps(key):
        for row in sweep["rows"]:
            deciding[_key(row)] = sweep
    return deciding


@pytest.mark.parametrize("key", sorted(SWEEPS))
def test_the_packaged_table_is_its_recorded_sweep_s_best(key: str) -> None:
    """Every entry of the packaged table (op x the 16 preset points) is the fastest config of
    the sweep recorded on that device: the table in the package is the measured one, not
    edited by hand."""
    packaged = json.loads((REPO / "kernels" / f"configs-{key}.json").read_text())
    tk = _tune_kernels()
    best: dict[tuple[str, str, int], str] = {}
    for sweep in _sweeps(key):
        assert sweep["key"] == key and packaged["tuned_on"]["device"] == sweep["device"]
        best.update({_key(e): e["config"] for e in tk.best_table(sweep)["entries"]})
    assert len(packaged["entries"]) == 48
    assert {_key(e): e["config"] for e in packaged["entries"]} == best


@pytest.mark.parametrize("key", sorted(SWEEPS))
def test_every_packaged_config_was_checked_right_and_beats_the_incumbent(key: str) -> None:
    """The sweep compared each packaged config's output with torch._grouped_mm's at its point,
    and timed the point's incumbent (the previous table's pick) beside it: the new pick is
    no slower there (by the rounds' medians where the sweep had rounds, which decided), and its
    name parses back to a launch config."""
    packaged = json.loads((REPO / "kernels" / f"configs-{key}.json").read_text())
    deciding = _last_sweep_of_each_entry(key)
    for entry in packaged["entries"]:
        sweep = deciding[_key(entry)]
        rows = {
            r["config"]: r
            for r in sweep["rows"]
            if r["impl"] == "qmoe" and r["tflops"] is not None and _key(r) == _key(entry)
        }
        chosen = rows[entry["config"]]
        assert chosen["rel_diff"] is not None and chosen["rel_diff"] < MAX_REL_DIFF
        incumbent = [r for r in rows.values() if r.get("incumbent")]
        assert incumbent, f"{_key(entry)}: the incumbent was not timed"
        def deciding_ms(row: dict[str, Any]) -> float:
            return float(row.get("final_ms") or row["ms"])

        assert deciding_ms(chosen) <= min(deciding_ms(r) for r in incumbent)
        assert config_from_name(entry["config"]).name == entry["config"]


def _row(config: str, ms: float | None, *, incumbent: bool = False) -> dict[str, Any]:
    return {
        "point": "30b-gate_up", "tokens": 2048, "m": 16384, "e": 128, "n": 1536, "k": 2048, "op": "forward",
        "impl": "qmoe", "config": config, "incumbent": incumbent, "path": "pointer", "ms": ms,
        "tflops": 100.0 / ms if ms else None, "rel_diff": 0.0, "note": "",
    }  # fmt: skip


def test_the_rounds_not_the_lucky_first_timing_pick_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fastest of many single timings is biased fast: the finalists (the 3 fastest of the
    first pass, and the incumbent wherever it ranked) are timed again, interleaved in a rotated
    order, and the medians of those rounds decide. Here "a" won the first pass by a lucky 0.90 ms
    but is 1.05 ms in the rounds, where "b" is 1.00; "d", slowest of the first pass, is timed
    again only as the incumbent; "e" (failed) and "f" (4th) are not timed again."""
    tk = _tune_kernels()
    rows = [_row("a", 0.90), _row("b", 0.95), _row("c", 0.97), _row("d", 1.30, incumbent=True), _row("e", None), _row("f", 1.1)]
    script = {"a": [1.05, 1.06, 1.04], "b": [1.00, 0.99, 1.01], "c": [1.02, 1.03, 1.02], "d": [1.20, 1.21, 1.19]}
    order: list[str] = []
    monkeypatch.setattr(tk, "bench_ms", lambda fn, args: fn())

    def timed(name: str) -> Any:
        def fn() -> float:
            order.append(name)
            return script[name].pop(0)

        return fn

    args = type("Args", (), {"finalists": 3, "rounds": 3})()
    tk.final_rounds(rows, {name: timed(name) for name in "abcdf"}, args)
    assert order == ["a", "b", "c", "d", "b", "c", "d", "a", "c", "d", "a", "b"]
    assert [r.get("final_ms") for r in rows] == [1.05, 1.00, 1.02, 1.20, None, None]
    table = tk.best_table({"rows": rows})
    (entry,) = table["entries"]
    assert entry["config"] == "b" and entry["ms"] == 1.0 and entry["tflops"] == 100.0
    assert entry["incumbent"] == "d" and entry["incumbent_tflops"] == round(100.0 / 1.20, 1)
    # with no rounds (--rounds 0, or a sweep recorded before them) the first pass decides
    first = [_row("a", 0.90), _row("b", 0.95)]
    tk.final_rounds(first, {"a": timed("a"), "b": timed("b")}, type("Args", (), {"finalists": 3, "rounds": 0})())
    assert tk.best_table({"rows": first})["entries"][0]["config"] == "a"


def test_rounds_that_fail_leave_the_first_pass_to_decide(monkeypatch: pytest.MonkeyPatch) -> None:
    tk = _tune_kernels()
    rows = [_row("a", 0.90), _row("b", 0.95)]

    def broken() -> float:
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(tk, "bench_ms", lambda fn, args: fn())
    tk.final_rounds(rows, {"a": broken, "b": broken}, type("Args", (), {"finalists": 3, "rounds": 2})())
    assert all("final_ms" not in r and r["rounds_note"].startswith("rounds not taken") for r in rows)
    assert tk.best_table({"rows": rows})["entries"][0]["config"] == "a"
