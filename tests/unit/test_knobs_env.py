"""Every ``QMOE_*`` environment variable is declared and read in ``qmoe_doctor/core/knobs.py``
(the monitor's bootstrap spells two again, checked in test_run_hook.py): the child side's
variables (config table, cache folder, lean launch, the ep block's three) included, each read by
a validating function whose refusal is one line naming the variable."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.core import knobs

REPO = Path(__file__).resolve().parents[2]
#: Where the product's code lives (tests may name variables of their own, e.g. QMOE_FUZZ_SCALE).
SOURCES = ("qmoe_doctor", "probes", "kernels", "benchmarks", "tools")
#: The one other file allowed to spell a variable: it imports nothing of ours before attaching.
BOOTSTRAP = REPO / "qmoe_doctor" / "monitor" / "bootstrap" / "sitecustomize.py"
VARIABLE = re.compile(r"QMOE_[A-Z0-9_]+")


def _spelt_outside_knobs() -> list[str]:
    found = []
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            if path == REPO / "qmoe_doctor" / "core" / "knobs.py" or path == BOOTSTRAP:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if VARIABLE.fullmatch(node.value):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    return found


def test_no_variable_is_spelt_outside_knobs() -> None:
    assert _spelt_outside_knobs() == []


def test_the_scan_would_see_a_variable_spelt_elsewhere() -> None:
    tree = ast.parse('NAME = "QMOE_DOCTOR_SOMETHING"\nTEXT = "see QMOE_X in the docs"\n')
    spelt = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and VARIABLE.fullmatch(str(n.value))]
    assert spelt == ["QMOE_DOCTOR_SOMETHING"]


def _refused(read: Callable[[dict[str, str]], Any], name: str, value: str) -> str:
    with pytest.raises(ValueError) as refused:
        read({name: value})
    message = str(refused.value)
    assert message.startswith(name) and "\n" not in message and len(message) < 300, message
    return message


def test_config_table_and_cache_dir_are_a_path_or_none() -> None:
    assert knobs.config_table({}) is None and knobs.config_table({knobs.QMOE_CONFIG_TABLE: "  "}) is None
    assert knobs.config_table({knobs.QMOE_CONFIG_TABLE: " /t/configs.json "}) == "/t/configs.json"
    assert knobs.cache_dir({}) is None
    assert knobs.cache_dir({knobs.QMOE_CACHE_DIR: "/scratch/q"}) == "/scratch/q"


@pytest.mark.parametrize(("value", "on"), [("", True), ("1", True), (" 0 ", False)])
def test_lean_launch_reads_0_and_1(value: str, on: bool) -> None:
    assert knobs.lean_launch({knobs.QMOE_LEAN_LAUNCH: value}) is on


@pytest.mark.parametrize("value", ["false", "no", "2", "off"])
def test_lean_launch_refuses_anything_else(value: str) -> None:
    _refused(knobs.lean_launch, knobs.QMOE_LEAN_LAUNCH, value)


def test_the_ep_variables_read_and_refuse_by_name() -> None:
    assert knobs.ep_micro_batches({}) == 1 and knobs.ep_micro_batches({knobs.QMOE_EP_MICRO_BATCHES: "2"}) == 2
    for bad in ("0", "-1", "two", "1.5", "²"):
        _refused(knobs.ep_micro_batches, knobs.QMOE_EP_MICRO_BATCHES, bad)
    assert knobs.ep_dispatch({}) == "auto"
    assert [knobs.ep_dispatch({knobs.QMOE_EP_DISPATCH: d}) for d in knobs.EP_DISPATCHES] == list(knobs.EP_DISPATCHES)
    assert "a2a, gather" in _refused(knobs.ep_dispatch, knobs.QMOE_EP_DISPATCH, "alltoall")
    assert knobs.ep_transport({}) == "auto"
    assert knobs.ep_transport({knobs.QMOE_EP_TRANSPORT: "collective"}) == "collective"
    _refused(knobs.ep_transport, knobs.QMOE_EP_TRANSPORT, "nvshmem")


def test_the_ep_choices_are_the_ones_the_block_takes() -> None:
    from qmoe_doctor.probes.parallel import ep_gather, modes

    assert knobs.EP_TRANSPORTS == ep_gather.TRANSPORTS
    assert modes.EP_DISPATCHES == knobs.EP_DISPATCHES


def test_the_kernels_read_the_variables_through_knobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lean launch path, this user's cache folder and the table override as the kernels see
    them: set through the variable knobs declares, refused by name when malformed."""
    from qmoe_doctor.core.launch_configs import ConfigTableError, DeviceFacts, user_cache_dir
    from qmoe_doctor.kernels import launch, tuning

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv(knobs.QMOE_LEAN_LAUNCH, "0")
    assert launch.lean_launch_enabled() is False
    monkeypatch.setenv(knobs.QMOE_LEAN_LAUNCH, "yes")
    with pytest.raises(ValueError, match=f"^{knobs.QMOE_LEAN_LAUNCH}="):
        launch.lean_launch_enabled()
    assert user_cache_dir({knobs.QMOE_CACHE_DIR: str(tmp_path)}) == tmp_path
    monkeypatch.setenv(knobs.QMOE_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(knobs.QMOE_CONFIG_TABLE, str(tmp_path / "missing.json"))
    facts = DeviceFacts(name="NVIDIA H100 80GB HBM3", capability=(9, 0), sms=132)
    with pytest.raises(ConfigTableError, match=f"^{knobs.QMOE_CONFIG_TABLE}="):
        tuning.choice_for(facts)
