"""tests/fixtures/MANIFEST.md against the fixture tree: every recording folder has an entry, every
entry a folder, each recording is read by a test, and no fixture path carries a work-history name.

A recording folder is ``<content>/<date>-<machine>-<commit>/`` (under ``reports/`` one level
deeper: ``reports/<command>/<recording>/``). "Read by a test" means a test module under tests/unit
names the folder, or, for ``sanitizer/`` and ``tracebacks/``, ``recorded_logs.py`` globs its files
(every ``*.log``, ``*.xml``, ``traceback-*.stderr[.gz]``), which the generic tests then read.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from recorded_logs import ALL_LOGS, ALL_TRACEBACKS, ALL_XML, FIXTURES, MANIFEST

UNIT = Path(__file__).resolve().parent
#: ``2026-11-22-2xh200-7ada31c``: date, machine (``h100``, ``h200``, ``<N>xh200``), short commit.
RECORDING = re.compile(r"^\d{4}-\d{2}-\d{2}-(?:\d+x)?h[0-9]{3}-[0-9a-f]{7,40}$")
CONTENT = ("sanitizer", "tracebacks", "profiles", "tuning", "monitor-records")
HAND_WRITTEN = ("configs", "lint", "kernels", "schemas")
ENTRY = re.compile(r"^### `([^`]+)/`\s*$", re.M)
#: Names that tell work history instead of content: sessions, numbered runs.
HISTORY = re.compile(r"session\d|(?<![a-z])runs?\d|run-?\d+[-_.]|h200x\d-run", re.I)


def recording_folders() -> list[str]:
    found: list[Path] = []
    for content in CONTENT:
        found.extend(p for p in (FIXTURES / content).iterdir() if p.is_dir())
    for command in (FIXTURES / "reports").iterdir():
        if command.is_dir():
            found.extend(p for p in command.iterdir() if p.is_dir())
    return sorted(p.relative_to(FIXTURES).as_posix() for p in found)


def manifest_entries() -> list[str]:
    return ENTRY.findall(MANIFEST.read_text(encoding="utf-8"))


def test_fixture_tree_has_only_known_top_folders() -> None:
    top = {p.name for p in FIXTURES.iterdir() if p.is_dir()}
    assert top <= {*CONTENT, "reports", *HAND_WRITTEN}, top - {*CONTENT, "reports", *HAND_WRITTEN}


def test_recording_folders_are_named_by_date_machine_and_commit() -> None:
    folders = recording_folders()
    assert folders
    bad = [f for f in folders if not RECORDING.match(f.rsplit("/", 1)[-1])]
    assert bad == []


def test_every_recording_folder_has_a_manifest_entry_and_back() -> None:
    entries = manifest_entries()
    assert len(entries) == len(set(entries)), "an entry is repeated"
    assert sorted(entries) == recording_folders()


@pytest.mark.parametrize("folder", recording_folders())
def test_every_recording_is_read_by_a_test(folder: str) -> None:
    name = folder.rsplit("/", 1)[-1]
    path = FIXTURES / folder
    globbed = {p.parent for p in (*ALL_LOGS, *ALL_XML, *ALL_TRACEBACKS)}
    readers = [
        p.name
        for p in sorted(UNIT.glob("*.py"))
        if p.name != Path(__file__).name and name in p.read_text(encoding="utf-8")
    ]
    assert readers or path in globbed, f"{folder}: no test names it and no generic test globs it"
    assert any(p.is_file() for p in path.rglob("*")), f"{folder} is empty"


def test_no_fixture_path_carries_a_work_history_name() -> None:
    paths = [p.relative_to(FIXTURES).as_posix() for p in FIXTURES.rglob("*")]
    assert paths
    assert [p for p in paths if HISTORY.search(p)] == []


def test_history_pattern_catches_the_old_names() -> None:
    """The check above can fail: names built as the fixtures' folders were before they were grouped
    (a session number, a run number in a folder or file name)."""
    history = [f"h200-{word}{n}{tail}" for word in ("session", "run", "runs") for n in (1, 63) for tail in ("", "-52", ".json")]
    for old in history:
        assert HISTORY.search(old), old
    for new in ("2026-11-22-2xh200-7ada31c", "scan-unmasked_rows.json", "run-ours.json.gz", "run-int32.json"):
        assert not HISTORY.search(new), new
