"""Every cause id has its docs page and every page a cause id; each page has the fixed parts; every
specimen is in the calibration table with the verdict it must get.

A diagnosis points the user at ``docs/causes/<id>.md`` (``Cause.docs``), so a cause without a page
is a dead link in every report that names it, and a page without a cause documents something the
doctor never says.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.specimens import SPECIMENS, SpecimenInfo, faulty_specimens

REPO = Path(__file__).resolve().parents[2]
CAUSE_DOCS = REPO / "docs" / "causes"
CALIBRATION = REPO / "docs" / "validation" / "scan-specimens.md"

#: The sections of a cause page, in this order (pip's DiagnosticPipError parts: what happened,
#: why, how we know, the hint, the reference; plus the faulty kernel that calibrates the doctor).
SECTIONS = ("What you see", "Mechanism", "How qmoe-doctor proves it", "Fix", "Public evidence", "Specimen")


def _page(cause_id: str) -> str:
    return (CAUSE_DOCS / f"{cause_id}.md").read_text(encoding="utf-8")


def _section(text: str, title: str) -> str:
    """The body of ``## title`` up to the next ``## `` heading."""
    body = text.split(f"\n## {title}\n", 1)[1]
    return body.split("\n## ", 1)[0]


def test_every_cause_has_a_page_and_every_page_a_cause() -> None:
    pages = {p.stem for p in CAUSE_DOCS.glob("*.md")}
    assert sorted(set(CAUSES) - pages) == [], "cause ids without docs/causes/<id>.md"
    assert sorted(pages - set(CAUSES)) == [], "docs/causes pages of no cause id"
    for cause in CAUSES.values():
        assert (REPO / cause.docs).is_file(), cause.docs


@pytest.mark.parametrize("cause_id", sorted(CAUSES))
def test_page_has_the_fixed_parts_in_order(cause_id: str) -> None:
    text = _page(cause_id)
    assert text.startswith(f"# `{cause_id}`: "), "the title names the id"
    head = text.split("\n## ", 1)[0]
    assert "\n**In one line:** " in head and "\n**Fix:** " in head, "the one-line summary and fix on top"
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert [h for h in headings if h in SECTIONS] == list(SECTIONS), headings
    for title in SECTIONS:
        assert _section(text, title).strip(), f"## {title} is empty"
    assert "```" in _section(text, "Fix"), "the fix is given as code"


@pytest.mark.parametrize("cause_id", sorted(CAUSES))
def test_public_evidence_section_cites_the_catalogue_s_reports(cause_id: str) -> None:
    """Each public report the catalogue (and so every diagnosis) cites is on the page: its project
    and every issue number."""
    evidence = _section(_page(cause_id), "Public evidence").lower()
    for report in CAUSES[cause_id].public_evidence:
        project = report.split()[0].lower()
        assert project in evidence, report
        for number in re.findall(r"#(\d+)", report):
            assert number in evidence, report


@pytest.mark.parametrize("specimen", faulty_specimens(), ids=lambda s: s.name)
def test_each_specimen_is_on_its_cause_page(specimen: SpecimenInfo) -> None:
    assert specimen.cause in CAUSES
    assert specimen.kernel_option in _section(_page(specimen.cause), "Specimen")


def test_calibration_table_lists_every_specimen_with_its_verdict() -> None:
    """docs/validation/scan-specimens.md's calibration table: one row per specimen, naming the
    cause it must get; the built-in kernel and the control must get none."""
    rows = {}
    table = _section(CALIBRATION.read_text(encoding="utf-8"), "Calibration: the verdict each kernel must get")
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            rows[cells[0].strip("`")] = cells[2]
    for specimen in SPECIMENS:
        assert specimen.kernel_option in rows, f"{specimen.kernel_option} not in the calibration table"
        if specimen.cause is None:  # a correct specimen must come out healthy
            assert rows[specimen.kernel_option].startswith("none"), specimen.kernel_option
            continue
        assert f"`{specimen.cause}`" in rows[specimen.kernel_option], specimen.kernel_option
    healthy_kernels = {"builtin", "torch:grouped_mm", "adapter:routed", "adapter:routed-rows"}
    for healthy in healthy_kernels:
        assert rows[healthy].startswith("none"), healthy
    assert set(rows) == {s.kernel_option for s in SPECIMENS} | healthy_kernels
