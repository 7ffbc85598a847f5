"""`qmoe-doctor run --sanitize` on one GPU: a program that over-routes the unmasked-rows specimen
through its own closure gets a diagnosis from memcheck's placed addresses, with the wrapper the
monitor named (run on a GPU machine with compute-sanitizer; skipped without them)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from qmoe_doctor.core.launches import FindingKind
from qmoe_doctor.machine.sanitizer import find_compute_sanitizer
from qmoe_doctor.workflows.run import RunOptions, run_program

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

#: 64 rows more on the last expert than x has: the tiles write 64 rows past the end of y.
PROGRAM = """\
import torch
from qmoe_doctor.kernels.specimens.unmasked_rows import moe_grouped_gemm

M, E, N, K = 1024, 8, 256, 256
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16)
m_sizes = torch.full((E,), M // E, device="cuda", dtype=torch.int32)


def forward(x, w, m_sizes):
    counts = m_sizes.clone()
    counts[-1] += 64
    return moe_grouped_gemm(x, w, counts)


forward(x, w, m_sizes)
torch.cuda.synchronize()
"""


@pytest.mark.skipif(find_compute_sanitizer(env=os.environ) is None, reason="compute-sanitizer not found")
def test_placed_writes_past_y_are_invalid_routing_with_the_scan_that_proves_it(tmp_path: Path) -> None:
    prog = tmp_path / "over_routed.py"
    prog.write_text(PROGRAM)
    report = run_program([sys.executable, str(prog)], RunOptions(sanitize=True, log_dir=tmp_path / "r"))
    s = report.sanitizer
    assert s is not None and s.ran and s.addresses, s
    placed = [d for d in report.diagnoses if d.kind is FindingKind.PLACED_ACCESS]
    assert [d.cause for d in placed] == ["invalid-routing"], (s.note, s.agreement)
    (d,) = placed
    assert d.repro == (
        "qmoe-doctor scan --kernel qmoe_doctor.kernels.specimens.unmasked_rows:moe_grouped_gemm --only over-routed"
    )
    # the tiles write rows past y, and may read rows past x: both fit the one cause
    assert "after the end of" in d.basis and "y_ptr" in d.basis and "not yet proven differentially" in d.basis
    launch = d.finding.launch
    assert launch is not None and launch.user_site is not None and launch.user_site.file == str(prog)
    assert all(a.gap is not None and a.relation == "after" for a in s.addresses if a.tensor)
