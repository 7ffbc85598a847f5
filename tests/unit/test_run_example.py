"""examples/qwen3_moe_device_map.py under `qmoe-doctor run` on the CPU: a Transformers Qwen3-MoE
model on our fused kernels (the Triton interpreter, float32), trained for two steps. Needs the
optional ``example`` extra (transformers, accelerate): skipped without it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from qmoe_doctor.workflows.run import RunOptions, run_program

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3_moe_device_map.py"


def test_the_example_trains_on_our_kernels_with_no_finding(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    report = run_program(
        [sys.executable, str(EXAMPLE), "--cpu", "--steps", "2"],
        RunOptions(log_dir=tmp_path),
        environ={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert report.exit_code == 0, report.passes[0].end
    assert report.healthy and not report.diagnoses
    (record,) = [r for r in report.passes[0].processes if r.launches]
    kernels = {k.name for k in record.kernels}
    assert "_grouped_gemm_kernel" in kernels, kernels
    forward = next(launch for launch in record.ring if launch.kernel == "_grouped_gemm_kernel" and launch.call_site)
    assert forward.call_site is not None and forward.call_site.file == str(EXAMPLE)
    assert forward.call_site.function == "forward"  # FusedMoE.forward: the user's line
    assert {t.name for t in forward.tensors} >= {"x_ptr", "w_ptr", "y_ptr", "m_sizes_ptr"}
