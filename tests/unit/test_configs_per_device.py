"""Which measured config table a device gets (``core.launch_configs.choose_table``, read by
``kernels/tuning.py``), with fake device facts: its own table, this user's tuned table, the
nearest of its compute capability, none; the user cache folder per platform; a malformed table
is an error that names the file. No GPU: the facts are what a device would report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qmoe_doctor.core import launch_configs as lc
from qmoe_doctor.core.launch_configs import (
    ConfigTableError,
    DeviceFacts,
    TableHeader,
    choose_table,
    read_table_header,
    user_cache_dir,
    user_table_path,
)
from qmoe_doctor.kernels import tuning

H100 = DeviceFacts(name="NVIDIA H100 80GB HBM3", capability=(9, 0), sms=132)
H100_PCIE = DeviceFacts(name="NVIDIA H100 PCIe", capability=(9, 0), sms=114)
H200 = DeviceFacts(name="NVIDIA H200", capability=(9, 0), sms=132)
A100 = DeviceFacts(name="NVIDIA A100-SXM4-80GB", capability=(8, 0), sms=108)


def _table(path: Path, facts: DeviceFacts, entries: list[dict[str, object]] | None = None, *, sms: bool = True) -> Path:
    tuned: dict[str, object] = {"device": facts.name, "capability": list(facts.capability)}
    if sms:
        tuned["sms"] = facts.sms
    path.write_text(json.dumps({"format": 1, "tuned_on": tuned, "entries": entries or []}))
    return path


def _header(tmp_path: Path, facts: DeviceFacts, name: str | None = None) -> TableHeader:
    return read_table_header(_table(tmp_path / (name or lc.table_file_name(facts)), facts))


# --------------------------------------------------------------------------------------------
# Keys, file names, the cache folder
# --------------------------------------------------------------------------------------------


def test_device_key_names_every_fact() -> None:
    assert H100.key == "nvidia-h100-80gb-hbm3-sm90-132sm"
    assert lc.table_file_name(H200) == "configs-nvidia-h200-sm90-132sm.json"
    assert H100_PCIE.key != H100.key and H100.key != H200.key  # name and SMs both tell apart


@pytest.mark.parametrize(
    "platform, env, want",
    [
        ("linux", {"HOME": "/home/u"}, "/home/u/.cache/qmoe-doctor"),
        ("linux", {"HOME": "/home/u", "XDG_CACHE_HOME": "/fast/cache"}, "/fast/cache/qmoe-doctor"),
        ("linux", {"HOME": "/home/u", "XDG_CACHE_HOME": "relative"}, "/home/u/.cache/qmoe-doctor"),
        ("darwin", {"HOME": "/Users/u"}, "/Users/u/Library/Caches/qmoe-doctor"),
        ("win32", {"HOME": "C:/Users/u", "LOCALAPPDATA": "C:/Users/u/AppData/Local"}, "C:/Users/u/AppData/Local/qmoe-doctor/Cache"),
        ("linux", {"HOME": "/home/u", lc.CACHE_ENV: "/scratch/q"}, "/scratch/q"),
    ],
)
def test_user_cache_folder_per_platform(platform: str, env: dict[str, str], want: str) -> None:
    """Where ``platformdirs.user_cache_dir("qmoe-doctor", appauthor=False)`` puts it, with the
    escape hatch first."""
    assert user_cache_dir(env, platform) == Path(want)


def test_user_table_path_is_in_the_cache_folder() -> None:
    env = {"HOME": "/home/u"}
    assert user_table_path(H100, env) == Path("/home/u/.cache/qmoe-doctor/configs") / lc.table_file_name(H100)


# --------------------------------------------------------------------------------------------
# Choosing
# --------------------------------------------------------------------------------------------


def test_each_device_gets_its_own_packaged_table(tmp_path: Path) -> None:
    packaged = [_header(tmp_path, H100), _header(tmp_path, H200)]
    for facts in (H100, H200):
        choice = choose_table(facts, packaged=packaged)
        assert choice.source == "packaged" and choice.tuned_on == facts.name
        assert choice.path == tmp_path / lc.table_file_name(facts)
        assert "this device" in choice.describe()


def test_another_card_of_the_same_capability_gets_the_nearest_and_is_told_to_tune(tmp_path: Path) -> None:
    packaged = [_header(tmp_path, H200)]
    choice = choose_table(H100, packaged=packaged)
    assert choice.source == "nearest" and choice.tuned_on == "NVIDIA H200"
    assert "tune_kernels.py --install" in choice.describe() and H100.key in choice.describe()
    # the same SM count is nearer than another (the persistent grids were sized alike)
    odd = TableHeader(path=tmp_path / "odd.json", device="NVIDIA H800", capability=(9, 0), sms=114)
    assert choose_table(H100, packaged=[_header(tmp_path, H200), odd]).tuned_on == "NVIDIA H200"
    assert choose_table(H100_PCIE, packaged=[odd, _header(tmp_path, H200)]).tuned_on == "NVIDIA H800"


def test_no_table_of_the_capability_means_the_fallback_table(tmp_path: Path) -> None:
    choice = choose_table(A100, packaged=[_header(tmp_path, H100), _header(tmp_path, H200)])
    assert choice.path is None and choice.source == "none"
    assert "8.0" in choice.describe() and "built-in fallback" in choice.describe()


def test_a_table_without_sms_matches_by_name_and_capability(tmp_path: Path) -> None:
    """The H200 table of 2026-11-22 was written before ``sms`` was recorded."""
    old = read_table_header(_table(tmp_path / "old.json", H200, sms=False))
    assert old.sms is None and old.matches(H200) and not old.matches(H100)
    assert choose_table(H200, packaged=[old]).source == "packaged"


def test_this_users_table_wins_over_the_packaged_one_and_the_override_over_both(tmp_path: Path) -> None:
    packaged = [_header(tmp_path, H100)]
    mine = read_table_header(_table(tmp_path / "mine.json", H100))
    assert choose_table(H100, packaged=packaged, user_table=mine).source == "user"
    forced = read_table_header(_table(tmp_path / "forced.json", H200))
    choice = choose_table(H100, packaged=packaged, user_table=mine, override=forced)
    assert choice.source == "env" and choice.path == tmp_path / "forced.json"
    # an override measured on another capability does not apply, and says so
    other = choose_table(A100, packaged=packaged, override=forced)
    assert other.path is None and lc.TABLE_ENV in other.describe() and "9.0" in other.describe()


def test_the_packaged_tables_are_each_for_one_device() -> None:
    headers = tuning.packaged_tables()
    assert headers, "no configs-*.json beside kernels/tuning.py"
    for h in headers:
        assert h.path.name.startswith(lc.TABLE_PREFIX)
        facts = DeviceFacts(name=h.device, capability=h.capability, sms=h.sms or 0)
        assert h.sms is None or h.path.name == lc.table_file_name(facts), h.path.name
        entries = tuning.load_table(h.path)
        assert {e.op for e in entries} == set(tuning.OPS), h.path.name
        for item in json.loads(h.path.read_text())["entries"]:  # what the tuner measured travels with it
            assert item["tflops"] > 0 and item["config"]


# --------------------------------------------------------------------------------------------
# The kernels' side: kernels/tuning.py on fake facts
# --------------------------------------------------------------------------------------------


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No override, an empty user cache under tmp_path."""
    monkeypatch.delenv(lc.TABLE_ENV, raising=False)
    monkeypatch.setenv(lc.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path


def test_lookup_picks_the_nearest_shape_of_the_device_table(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [
        {"op": "forward", "avg_rows": 16, "n": 1536, "k": 2048, "config": "64x128x64-w4-s4"},
        {"op": "forward", "avg_rows": 128, "n": 1536, "k": 2048, "config": "128x256x64-w8-s4-tma-flat"},
        {"op": "dw", "avg_rows": 128, "n": 1536, "k": 2048, "config": "32x128x128-w4-s4-p2-tma"},
    ]
    path = _table(isolated / "t.json", H100, entries)
    monkeypatch.setenv(lc.TABLE_ENV, str(path))
    assert tuning.lookup("forward", 100, 1536, 2048, H100).name == "128x256x64-w8-s4-tma-flat"  # type: ignore[union-attr]
    assert tuning.lookup("forward", 20, 2048, 2048, H100).name == "64x128x64-w4-s4"  # type: ignore[union-attr]
    assert tuning.lookup("dw", 20, 1536, 2048, H100).name == "32x128x128-w4-s4-p2-tma"  # type: ignore[union-attr]
    assert tuning.lookup("dx", 128, 1536, 2048, H100) is None  # no dx entry: the fallback table
    assert tuning.lookup("forward", 128, 1536, 2048, A100) is None  # not measured on Ampere


def test_an_installed_user_table_is_seen_without_a_restart(isolated: Path) -> None:
    user = user_table_path(H100)
    user.parent.mkdir(parents=True)
    before = tuning.choice_for(H100)
    assert before.source in ("packaged", "nearest")
    entries = [{"op": "forward", "avg_rows": 128, "n": 1536, "k": 2048, "config": "128x128x64-w8-s3"}]
    _table(user, H100, entries)
    after = tuning.choice_for(H100)
    assert after.source == "user" and after.path == user
    assert tuning.lookup("forward", 128, 1536, 2048, H100).name == "128x128x64-w8-s3"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "JSONDecodeError"),
        (json.dumps({"entries": []}), "tuned_on"),
        (json.dumps({"tuned_on": {"device": "x", "capability": [9, 0]}, "entries": {}}), "entries"),
        (
            json.dumps(
                {
                    "tuned_on": {"device": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "sms": 132},
                    "entries": [{"op": "forward", "avg_rows": 1, "n": 1, "k": 1, "config": "nope"}],
                }
            ),
            "launch config 'nope'",
        ),
        (
            json.dumps(
                {
                    "tuned_on": {"device": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "sms": 132},
                    "entries": [{"op": "fwd", "avg_rows": 1, "n": 1, "k": 1, "config": "64x64x64-w4-s3"}],
                }
            ),
            "unknown op 'fwd'",
        ),
    ],
)
def test_a_malformed_user_table_is_an_error_naming_the_file(isolated: Path, content: str, says: str) -> None:
    """Never a silent fallback: the user tuned this table, and a broken one must be fixed or
    deleted (the message names it)."""
    user = user_table_path(H100)
    user.parent.mkdir(parents=True)
    user.write_text(content)
    with pytest.raises(ConfigTableError, match=says) as info:
        tuning.lookup("forward", 128, 1536, 2048, H100)
    assert str(user) in str(info.value)


def test_a_missing_override_is_an_error_naming_it(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lc.TABLE_ENV, str(isolated / "missing.json"))
    with pytest.raises(ConfigTableError, match="missing.json"):
        tuning.lookup("forward", 1, 1, 1, H100)


def test_off_the_table_the_kernels_pick_from_the_one_fallback_table(
    isolated: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no measured table covers the device (an A100 here), pick_config and
    pick_dw_config take core.launch_configs' entry for the shape class, pruned to the device's
    shared memory; on the CPU (the interpreter) its "interpreter" entry."""
    from qmoe_doctor.core.launch_configs import DW_CONFIGS, GEMM_CONFIGS
    from qmoe_doctor.kernels import backward as bw
    from qmoe_doctor.kernels import grouped_gemm as gg

    monkeypatch.setattr(tuning, "device_facts", lambda index: A100)
    for module in (gg, bw):
        monkeypatch.setattr(module, "smem_limit", lambda index: 10**9)
    pick, pick_dw = gg._pick_config.__wrapped__, bw._pick_dw_config.__wrapped__  # past the caches
    f32 = torch.float32
    assert pick(64 * 8, 1024, 512, 8, 0, f32, "forward").tile == GEMM_CONFIGS["few-rows"]
    assert pick(65 * 8, 256, 512, 8, 0, f32, "forward").tile == GEMM_CONFIGS["wide-n"]
    assert pick(65 * 8, 255, 512, 8, 0, f32, "dx").tile == GEMM_CONFIGS["default"]
    assert pick_dw(128, 128, 0, f32, 128.0).tile == DW_CONFIGS["wide"]
    assert pick_dw(127, 4096, 0, f32, 128.0).tile == DW_CONFIGS["narrow"]
    default = GEMM_CONFIGS["default"]
    monkeypatch.setattr(gg, "smem_limit", lambda index: default.smem_bytes(4) - 1)
    pruned = pick(65 * 8, 255, 512, 8, 0, f32, "forward")
    assert pruned.tile == default._replace(num_stages=default.num_stages - 1)
    cpu = torch.device("cpu")
    assert gg.pick_config(64, 32, 32, 4, cpu, f32).tile == GEMM_CONFIGS["interpreter"]
    assert bw.pick_dw_config(32, 32, cpu, f32).tile == GEMM_CONFIGS["interpreter"]


def test_on_an_h100_the_packaged_pick_comes_from_the_h100_table_or_the_h200s(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an H100 gets today, without a GPU: its own table where one is packaged, else the
    H200's (nearest, same capability); the bench header names which."""
    monkeypatch.setattr(tuning, "device_facts", lambda index: H100)
    text = tuning.describe_device_table(0)
    own = (tuning.PACKAGE_DIR / lc.table_file_name(H100)).is_file()
    assert (lc.table_file_name(H100) if own else lc.table_file_name(H200)) in text
    assert tuning.choice_for(H100).source == ("packaged" if own else "nearest")
    assert ("(nearest," in text) != own


def test_the_tuner_installs_its_table_where_the_kernels_look(tmp_path: Path) -> None:
    """``tune_kernels.py --install`` (the CPU smoke run: a "cpu" device no GPU matches) writes
    the table under this user's cache folder, named for the device, in the form the kernels read."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    cache = tmp_path / "cache"
    env = {**os.environ, "TRITON_INTERPRET": "1", lc.CACHE_ENV: str(cache)}
    done = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "tune_kernels.py"), "--tiny", "--ops", "forward", "--install", "--out", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    installed = list((cache / "configs").glob("configs-*.json"))
    assert len(installed) == 1 and installed[0].name.startswith("configs-cpu-triton-interpreter-sm00-")
    header = read_table_header(installed[0])
    assert header.device == "cpu (Triton interpreter)" and header.capability == (0, 0) and header.sms
    assert (tmp_path / "out" / installed[0].name).read_text() == installed[0].read_text()
