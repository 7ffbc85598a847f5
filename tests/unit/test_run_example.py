"""The examples under `qmoe-doctor run` on the CPU (the Triton interpreter, float32):
examples/qwen3_moe_device_map.py, a Transformers Qwen3-MoE model on our fused kernels trained for
two steps (needs the optional ``example`` extra, transformers and accelerate: skipped without it),
and examples/moe_ranks.py, two torchrun ranks (gloo) training the MoE block."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from qmoe_doctor.workflows.run import RunOptions, run_program

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "qwen3_moe_device_map.py"
RANKS = EXAMPLE.with_name("moe_ranks.py")


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


def test_the_example_on_our_kernels_is_deterministic_under_compare_repeat(tmp_path: Path) -> None:
    """Our kernels, fingerprinted launch by launch in two runs of the example: every launch equal."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    report = run_program(
        [sys.executable, str(EXAMPLE), "--cpu", "--steps", "1"],
        RunOptions(log_dir=tmp_path, compare="repeat", repeat=1),
        environ={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert report.exit_code == 0, report.passes[0].end
    c = report.compare
    assert c is not None and c.divergence is None and c.nondeterminism is None, c.verdict
    (proc,) = c.processes
    assert proc.compared == proc.printed > 0 and not proc.stop
    assert c.verdict.startswith(f"deterministic: {proc.compared} launches gave equal prints in all 2 runs")
    assert report.healthy


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ranks_example_reads_its_arguments_and_the_launchers_variables() -> None:
    ranks = _load(RANKS)
    args = ranks.parse_args(["--cpu", "--steps", "1", "-k", "specimen:rank_no_set_device"])
    assert args.cpu and args.steps == 1 and args.kernel == "specimen:rank_no_set_device"
    assert args.tokens is None and args.preset is None  # the CPU's and the GPU's defaults are main's
    with pytest.raises(SystemExit):
        ranks.parse_args(["--steps", "0"])
    assert ranks.rank_env({}) == (0, 0, 1)  # run alone
    assert ranks.rank_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}) == (3, 1, 4)


def test_the_ranks_example_under_torchrun_has_a_record_per_rank_and_no_finding(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    report = run_program(
        [*argv, str(RANKS), "--cpu", "--steps", "1"],
        RunOptions(log_dir=tmp_path),
        environ={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"},
    )
    assert report.exit_code == 0, report.passes[0].end
    assert report.healthy and not report.diagnoses
    ranks = sorted((r for r in report.passes[0].processes if r.launches), key=lambda r: r.rank or 0)
    assert [(r.rank, r.local_rank, r.world_size) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    for record in ranks:
        assert "_grouped_gemm_kernel" in {k.name for k in record.kernels}
        forward = next(launch for launch in record.ring if launch.kernel == "_grouped_gemm_kernel" and launch.call_site)
        assert forward.call_site is not None and forward.call_site.file == str(RANKS)  # the rank's own line


def test_the_device_map_example_takes_side_stream_and_ignores_it_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    example = _load(EXAMPLE)  # its imports of torch and Transformers wait for main
    assert example.parse_args(["--gpus", "0,1", "--side-stream"]).side_stream
    assert not example.parse_args([]).side_stream

    class Model(torch.nn.Module):  # stands for the Transformers model (not needed for this)
        def __init__(self) -> None:
            super().__init__()
            self.model = SimpleNamespace(layers=[None])
            self.scale = torch.nn.Parameter(torch.ones(()))

        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
            return SimpleNamespace(loss=self.scale * input_ids.float().mean())

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(example, "build", lambda args, devices, dtype: (Model(), {"model": "cpu"}))
    assert example.main(["--cpu", "--side-stream", "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    assert "--side-stream: the CPU has no CUDA stream; ignored" in err and "step 1/1" in out
    assert example.parse_args(["--race", "side-stream"]).race == "side-stream" and example.parse_args([]).race is None
    with pytest.raises(SystemExit):
        example.parse_args(["--race", "sometimes"])
    assert example.main(["--cpu", "--race", "producer", "--steps", "1"]) == 0
    assert "--race: the CPU has no CUDA stream; ignored" in capsys.readouterr().err


def test_the_race_wrapper_passes_cpu_tensors_straight_through() -> None:
    import torch

    example = _load(EXAMPLE)
    calls = []

    def kernel(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        return x

    x = torch.ones(2)
    assert example.raced(kernel, "side-stream")(x, x, x) is x and calls == [x]  # no stream, no copy
