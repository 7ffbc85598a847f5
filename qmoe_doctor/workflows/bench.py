"""`qmoe-doctor bench`, parent side: run the measuring child and read its report back.

The records, the implementation names and the arithmetic are ``qmoe_doctor.core.bench`` (the
child imports them too). Data flows one way::

    BenchRequest --(JSON argument)--> python -m qmoe_doctor.probes.bench --> BenchReport (JSON file)
    BenchReport --cli.render.bench--> terminal (rich) | JSON document (kind "bench") | PNG (reports.plot)

The measuring happens in a child process (a fresh interpreter, pinned to the chosen GPUs by
UUID); this module never imports torch. Its output goes to ``bench.log`` in the run's --out
folder, which is the run's product, kept: bench makes no temporary log folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from qmoe_doctor.core import knobs
from qmoe_doctor.core.bench import (
    BENCH_FILES,
    DEFAULT_TIMEOUT_S,
    KERNEL_UNUSABLE_EXIT,
    KERNEL_UNUSABLE_PREFIX,
    BenchReport,
    BenchRequest,
    report_document,
    report_from_jsonable,
)
from qmoe_doctor.core.inputs import read_text
from qmoe_doctor.core.records import to_json
from qmoe_doctor.isolate.one_shot import ChildRun, stream_child
from qmoe_doctor.isolate.process import SpawnError, child_env, child_python
from qmoe_doctor.machine.inventory import GpuInfo, child_cuda_env
from qmoe_doctor.workflows.scan import KernelUnusable

CHILD_MODULE = "qmoe_doctor.probes.bench"


class BenchError(Exception):
    """The measuring child failed: it crashed, timed out or wrote no report."""

    def __init__(self, message: str, *, tail: str = "", returncode: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.tail = tail
        self.returncode = returncode


def load_report(path: str | os.PathLike[str]) -> BenchReport:
    """A bench report from a JSON file (this version's, or the run-3 script's), read through the
    bounded reader (``InputError`` for a missing, special or oversized file)."""
    return report_from_jsonable(json.loads(read_text(path, errors="strict")))


def child_command(request: BenchRequest, python: str | None = None) -> list[str]:
    return [child_python(python), "-m", CHILD_MODULE, to_json(request)]


def child_environment(gpus: Sequence[GpuInfo], *, tiny: bool) -> dict[str, str]:
    """The child's environment: pinned to ``gpus`` by UUID (none: every GPU hidden), the
    interpreter on for --tiny, NVLink multicast off (isolate.FORCED_ENV)."""
    extra = child_cuda_env(gpus)
    if tiny:
        extra[knobs.TRITON_INTERPRET] = "1"
    else:
        extra[knobs.TRITON_INTERPRET] = "0"  # an inherited 1 would time the interpreter
    return child_env(extra)


def run_bench(
    request: BenchRequest,
    *,
    gpus: Sequence[GpuInfo] = (),
    workdir: Path,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> BenchReport:
    """Measure ``request`` in a child pinned to ``gpus`` (the first is cuda:0 there; with
    placement the second is cuda:1). The child's output goes to ``workdir/bench.log``.
    Raises BenchError when the child fails or writes no report, KernelUnusable when the
    request's --kernel does not resolve in the child (its import or signature)."""
    created = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    result = workdir / ".bench-child.json"
    with contextlib.suppress(FileNotFoundError):
        result.unlink()
    request = dataclasses.replace(request, result_path=str(result.resolve()))
    try:
        run: ChildRun = stream_child(
            child_command(request, python),
            child_environment(gpus, tiny=request.tiny),
            timeout_s=timeout_s,
            on_line=on_line,
            log_path=workdir / BENCH_FILES["log"],
        )
    except SpawnError as exc:
        raise BenchError(str(exc)) from exc
    if run.returncode is None:
        raise BenchError(f"the benchmark child did not finish in {timeout_s:.0f} s (killed)", tail=run.tail)
    unusable = _kernel_unusable(run) if run.returncode == KERNEL_UNUSABLE_EXIT else None
    if unusable is not None:  # a usage error, said whole on the way out: nothing is left behind
        with contextlib.suppress(OSError):
            (workdir / BENCH_FILES["log"]).unlink()
            if created:
                workdir.rmdir()
        raise KernelUnusable(unusable)
    if run.returncode != 0:
        raise BenchError(
            f"the benchmark child exited with status {run.returncode}",
            tail=run.tail,
            returncode=run.returncode,
        )
    try:
        doc = json.loads(result.read_text(encoding="utf-8"))
        report = report_from_jsonable(doc)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise BenchError(f"the benchmark child wrote no readable report: {exc}", tail=run.tail) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            result.unlink()
    return dataclasses.replace(report, gpus=tuple(g.index for g in gpus))


def _kernel_unusable(run: ChildRun) -> str | None:
    """The child's reason, when it ended because the --kernel did not resolve (its last line
    that starts with KERNEL_UNUSABLE_PREFIX); None for any other end with the same status."""
    for line in reversed(run.lines):
        if line.startswith(KERNEL_UNUSABLE_PREFIX):
            return line.removeprefix(KERNEL_UNUSABLE_PREFIX).strip() or "the kernel could not be resolved"
    return None


def write_json(report: BenchReport, path: Path, files: Mapping[str, str | None] | None = None) -> None:
    path.write_text(
        json.dumps(report_document(report, files), indent=2, allow_nan=True) + "\n", encoding="utf-8"
    )


__all__ = [
    "CHILD_MODULE",
    "BenchError",
    "child_command",
    "child_environment",
    "load_report",
    "run_bench",
    "write_json",
]
