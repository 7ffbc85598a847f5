"""Record real compute-sanitizer logs and Python tracebacks from probe runs (GPU machine).

    python3 tools/evidence/record_sanitizer_logs.py OUTDIR [CASE...]

Each case runs tools/evidence/run_probe.py in a fresh process, optionally under compute-sanitizer, and
keeps its stdout/stderr and the sanitizer log verbatim: they become tests/fixtures/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from qmoe_doctor.core.records import Condition, ProbeSpec, Shape, to_json

SMALL = Shape(m=256, e=8, n=256, k=256, dtype="bfloat16", routing="uniform")
SPEC = "qmoe_doctor.kernels.specimens.{}:moe_grouped_gemm"


def spec(pid: str, kernel: str, cond: Condition, shape: Shape = SMALL, **params: object) -> ProbeSpec:
    pair = cond.is_pair
    return ProbeSpec(
        probe_id=pid,
        kernel=kernel,
        condition=cond,
        device=1 if pair else 0,
        current=0,
        shape=shape,
        params=dict(params),
    )


BOUNDARY = Shape(m=256, e=70, n=5120, k=6144, dtype="bfloat16", routing="expert:69")

# name, spec, sanitizer tool or None, raw traceback?, extra env
CASES = [
    ("memcheck-builtin-clean", spec("single", "builtin", Condition.SINGLE), "memcheck", False, {}),
    ("racecheck-builtin-clean", spec("single", "builtin", Condition.SINGLE), "racecheck", False, {}),
    (
        "memcheck-unmasked-overrouted-nocache",
        spec("over", SPEC.format("unmasked_rows"), Condition.OVER_ROUTED),
        "memcheck",
        False,
        {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
    ),
    (
        "memcheck-unmasked-overrouted-cached",
        spec("over", SPEC.format("unmasked_rows"), Condition.OVER_ROUTED),
        "memcheck",
        False,
        {},
    ),
    (
        "traceback-unmasked-far-overrouted",
        spec("over", SPEC.format("unmasked_rows"), Condition.OVER_ROUTED, extra_rows=1 << 20),
        None,
        True,
        {},
    ),
    (
        "memcheck-unmasked-far-overrouted",
        spec("over", SPEC.format("unmasked_rows"), Condition.OVER_ROUTED, extra_rows=1 << 20),
        "memcheck",
        False,
        {},
    ),
    (
        "traceback-unguarded-nopeer",
        spec("0->1/no-peer", SPEC.format("unguarded"), Condition.NO_PEER),
        None,
        True,
        {},
    ),
    (
        "traceback-default-buffer-peer",
        spec("0->1/peer", SPEC.format("default_buffer"), Condition.PEER),
        None,
        True,
        {},
    ),
    ("initcheck-builtin-clean", spec("single", "builtin", Condition.SINGLE), "initcheck", False, {}),
    ("synccheck-builtin-clean", spec("single", "builtin", Condition.SINGLE), "synccheck", False, {}),
    (
        "memcheck-xml-unmasked-overrouted-nocache",
        spec("over", SPEC.format("unmasked_rows"), Condition.OVER_ROUTED),
        "memcheck-xml",
        False,
        {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
    ),
    (
        "traceback-launch-config-over-limit",
        spec(
            "cfg",
            "builtin",
            Condition.LAUNCH_CONFIG,
            block_m=128,
            block_n=256,
            block_k=128,
            num_warps=8,
            num_stages=4,
            variant="128x256x128-w8-s4",
        ),
        None,
        True,
        {},
    ),
    (
        "traceback-unguarded-peer-race",
        spec("0->1/producer-race", SPEC.format("unguarded"), Condition.PRODUCER_RACE),
        None,
        True,
        {},
    ),
    (
        "traceback-int32-debug",
        spec("boundary", SPEC.format("int32_offsets"), Condition.INT32_BOUNDARY, BOUNDARY),
        None,
        True,
        {"TRITON_DEBUG": "1"},
    ),
]


def main(out: Path, only: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    here = Path(__file__).resolve().parent
    for name, s, tool, raw, env_extra in CASES:
        if only and name not in only:
            continue
        env = {**os.environ, **env_extra}
        cmd = [sys.executable, str(here / "run_probe.py")] + (["--raw"] if raw else []) + [to_json(s)]
        if tool == "memcheck-xml":
            cmd = [
                sanitizer,
                "--tool",
                "memcheck",
                "--print-limit",
                "50",
                "--xml",
                "--save",
                str(out / f"{name}.xml"),
            ] + cmd
        elif tool:
            log = out / f"{name}.log"
            cmd = [sanitizer, "--tool", tool, "--print-limit", "50", "--log-file", str(log)] + cmd
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
            rc, so, se = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, so, se = "timeout", str(exc.stdout), str(exc.stderr)
        (out / f"{name}.stdout").write_text(so or "")
        (out / f"{name}.stderr").write_text(se or "")
        print(f"{name:45s} rc={rc} {time.time() - t0:6.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
