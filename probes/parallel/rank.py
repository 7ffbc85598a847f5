"""One rank of a parallel run: ``python -m qmoe_doctor.probes.parallel.rank --spec F --out DIR``.

Started by ``torch.distributed.run`` (dp, tp, ep: RANK, LOCAL_RANK and WORLD_SIZE come from it)
or alone (pp and the one-device baseline: rank 0 of 1). Files, all in DIR, named by global rank:

* ``rank-R.log``: this rank's stdout and stderr (redirected first thing, before torch is
  imported) and, through ``faulthandler``, the stacks of a crash or of SIGUSR1 (the parent sends
  it before killing a rank that hung);
* ``rank-R.crumbs``: JSON lines, each written and flushed at once: ``{"type": "start", "pid",
  "rank", "local_rank", "world_size", "host"}`` first, then a ``crumb`` (phase) or ``stage``
  line before each step and a ``fact`` line for each observation, so that a rank that dies
  (signal, SIGKILL, abort in a collective) still says where it was and what it had seen;
* ``rank-R.json``: one line, the rank's ``Outcome`` (``records.to_json``), written last
  (atomically: a partial file never appears). Missing for a rank that died.

Exit status: 0 when the outcome is written and not an error; 1 for an error outcome (so
torchrun stops the other ranks, which may wait in a collective for this one). Interpreter
teardown is skipped (``os._exit``): after a CUDA fault, library exit hooks can hang.

``params["inject"]`` (self-tests of the orchestration only): ``{"rank": R, "stage": S,
"action": "raise" | "exit" | "hang" | "abort", "code": N, "message": M}`` makes rank R misbehave on
entering stage S ("start", before torch is imported; "setup", after the process group;
"forward", at the checked step).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qmoe_doctor.core import error_kind, knobs, lifeline
from qmoe_doctor.core.records import (
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Status,
    from_json,
    from_jsonable,
    rank_spec,
    to_json,
    to_jsonable,
)
from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.worker import exception_message, exception_type_name

if TYPE_CHECKING:  # modes imports torch: loaded only once the rank runs
    from qmoe_doctor.probes.parallel.modes import KernelSpy

#: Outcome fields a runner may return (the rest the rank fills itself).
_RUNNER_FIELDS = frozenset({"status", "rel_error", "tolerance", "out_device", "kernel_ms"})


def result_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank-{rank}.json"


def crumbs_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank-{rank}.crumbs"


def log_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank-{rank}.log"


class RankContext(ProbeContext):
    """A ProbeContext whose breadcrumbs, stages and facts also go to ``rank-R.crumbs`` as they
    happen, and which knows its rank and the self-test injection."""

    spy: KernelSpy | None = None  # the mode's, once set up (read again after a failure)

    def __init__(
        self, spec: ProbeSpec, *, rank: int, local_rank: int, world_size: int, out_dir: Path
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.out_dir = out_dir
        self._crumbs = os.open(crumbs_path(out_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._stage = "start"
        super().__init__(spec, self._write)
        inject = spec.params.get("inject")
        self._inject = inject if isinstance(inject, dict) else None

    def _write(self, message: dict[str, Any]) -> None:
        line = json.dumps(
            {**message, "stage": self._stage}, separators=(",", ":"), allow_nan=True, default=str
        )
        os.write(self._crumbs, line.encode() + b"\n")  # one write: the line is whole or absent

    def stage(self, name: str) -> None:
        """A finer place than the phase ("init-process-group", "reference", "timing", ...)."""
        self._stage = name
        self._write({"type": "stage", "phase": self.phase.value, "t": time.time()})
        self.inject(name)

    def fact(self, key: str, value: Any) -> None:
        super().fact(key, value)
        self._write({"type": "fact", "key": key, "value": self.facts[key]})

    def note(self, text: str) -> None:
        super().note(text)
        self._write({"type": "note", "text": str(text)})

    def inject(self, stage: str) -> None:
        """Self-tests only: misbehave on entering ``stage`` when params["inject"] says so."""
        spec = self._inject
        if not spec or int(spec.get("rank", -1)) != self.rank or spec.get("stage") != stage:
            return
        action = spec.get("action")
        message = str(spec.get("message", f"injected {action} at {stage} on rank {self.rank}"))
        print(message, flush=True)
        if action == "raise":
            raise RuntimeError(message)
        if action == "exit":
            sys.stdout.flush()
            os._exit(int(spec.get("code", 3)))
        if action == "hang":
            while True:
                time.sleep(1.0)
        if action == "abort":
            os.kill(os.getpid(), signal.SIGABRT)
            time.sleep(5.0)
        raise ValueError(f"unknown injected action {action!r}")


def _environment() -> tuple[int, int, int]:
    """(global rank, local rank, world size) as torchrun sets them; (0, 0, 1) when run alone."""
    return (
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("LOCAL_RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
    )


def run(ctx: RankContext) -> dict[str, Any]:
    """Import, set up the rank, run its mode. Returns Outcome fields (raises on failure)."""
    ctx.crumb(Phase.IMPORT)
    ctx.stage("import")
    import torch
    import torch.distributed as dist

    from qmoe_doctor.probes.loader import load_kernel
    from qmoe_doctor.probes.parallel import modes
    from qmoe_doctor.probes.parallel.hooks import hooks_for

    spec = ctx.spec
    p = modes.RunParams.from_spec(spec)
    mode = modes.MODE_OF.get(spec.condition)
    if mode is None:
        raise ValueError(f"{spec.condition} is not a parallel mode")
    kernel = load_kernel(spec.kernel)
    hooks = hooks_for(kernel)
    if hooks.overridden:
        ctx.fact("parallel.hooks", list(hooks.overridden))
    distributed = ctx.world_size > 1 or mode in ("dp", "tp", "ep")
    if mode in ("dp", "tp", "ep") and ctx.local_rank >= len(p.devices):
        raise ValueError(
            f"local rank {ctx.local_rank} has no device in params['devices'] = {list(p.devices)}"
        )
    ordinal = p.devices[ctx.local_rank if mode in ("dp", "tp", "ep") else 0]
    device = torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)
    ctx.fact("parallel.mode", mode)
    ctx.fact("parallel.rank", ctx.rank)
    ctx.fact("parallel.local_rank", ctx.local_rank)
    ctx.fact("parallel.world_size", ctx.world_size)
    ctx.fact("parallel.host", socket.gethostname())
    ctx.fact("parallel.device", str(device))
    # what this rank really ran with: NVLink multicast must stay off in every rank
    watched = (*knobs.NVLS_OFF, knobs.CUDA_VISIBLE_DEVICES, knobs.TRITON_INTERPRET)
    ctx.fact("parallel.env", {name: os.environ.get(name) for name in watched})

    ctx.crumb(Phase.SETUP)
    ctx.stage("set-device")
    hooks.set_device(device)  # the correct hook: torch.cuda.set_device(device)
    if device.type == "cuda":
        ctx.fact("parallel.current_device_after_setup", torch.cuda.current_device())
    if distributed:
        import datetime

        ctx.stage("init-process-group")
        dist.init_process_group(backend=p.backend, timeout=datetime.timedelta(seconds=p.pg_timeout_s))
        if dist.get_world_size() != ctx.world_size or dist.get_rank() != ctx.rank:
            raise RuntimeError(
                f"process group says rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"the environment rank {ctx.rank} of {ctx.world_size}"
            )
        ctx.fact("parallel.backend", dist.get_backend())
    ctx.stage("setup")
    world = modes.World(
        rank=ctx.rank,
        local_rank=ctx.local_rank,
        size=ctx.world_size,
        device=device,
        backend=p.backend,
        distributed=distributed,
    )
    s = modes.setup(ctx, spec, p, world, kernel, hooks)
    ctx.spy = s.spy  # for the failure path below
    fields = modes.RUNNERS[mode](s)
    ctx.stage("teardown")
    if distributed:
        world.barrier()  # nobody leaves while a peer still needs it in a collective
        dist.destroy_process_group()
    return fields


def _failure_facts(ctx: RankContext) -> None:
    """What can still be read after a failure: the kernel spy and where memory went."""
    spy = ctx.spy
    try:
        if spy is not None:
            ctx.fact("parallel.kernel_calls", spy.summary())
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
            contexts = [i for i in range(torch.cuda.device_count()) if has_context is None or has_context(i)]
            ctx.fact("parallel.contexts", contexts)
            ctx.fact(
                "parallel.peak_allocated", {str(i): int(torch.cuda.max_memory_allocated(i)) for i in contexts}
            )
            ctx.fact("parallel.current_device", torch.cuda.current_device())
    except Exception as exc:  # a poisoned context may refuse even this
        ctx.note(f"device facts after the failure could not be read: {type(exc).__name__}: {exc}")


def execute(ctx: RankContext) -> Outcome:
    start = time.perf_counter()
    try:
        fields = run(ctx)
        bad = sorted(set(fields) - _RUNNER_FIELDS)
        if bad:
            raise RuntimeError(f"the runner returned fields the rank owns: {bad}")
        data = to_jsonable(
            {
                **fields,
                "probe_id": ctx.spec.probe_id,
                "spec": ctx.spec,
                "phase": Phase.DONE,
                "facts": ctx.facts,
                "notes": ctx.notes,
                "wall_s": time.perf_counter() - start,
            }
        )
        ctx.crumb(Phase.DONE)
        return _outcome(data)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt are outcomes too
        wall_s = time.perf_counter() - start
        traceback.print_exc()
        sys.stderr.flush()
        _failure_facts(ctx)
        error_type = exception_type_name(exc)
        message = exception_message(exc, who="rank")
        kind = (
            ErrorKind.OTHER
            if isinstance(exc, (SystemExit, KeyboardInterrupt))
            else error_kind.classify_error(error_type, message)
        )
        return Outcome(
            probe_id=ctx.spec.probe_id,
            spec=ctx.spec,
            status=Status.ERROR,
            phase=ctx.phase,
            error_kind=kind,
            error_type=error_type,
            error_message=message,
            facts={**ctx.facts, "parallel.at": ctx._stage},
            notes=ctx.notes,
            wall_s=wall_s,
        )


def _outcome(data: dict[str, Any]) -> Outcome:
    json.dumps(data, allow_nan=True)
    return from_jsonable(Outcome, data)


def write_result(out_dir: Path, rank: int, outcome: Outcome) -> None:
    tmp = out_dir / f".rank-{rank}.json.tmp"
    tmp.write_text(to_json(outcome) + "\n")
    os.replace(tmp, result_path(out_dir, rank))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qmoe_doctor.probes.parallel.rank")
    parser.add_argument("--spec", required=True, help="the run's ProbeSpec, one JSON document")
    parser.add_argument("--out", required=True, help="the run directory (rank files go here)")
    args = parser.parse_args(argv)
    # Die with the launcher: torchrun starts each rank in a session of its own, so a torchrun
    # killed by SIGKILL (the doctor's parent-death signal, when the doctor itself was killed)
    # would leave its ranks running, on the GPUs.
    lifeline.die_with_parent()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rank, local_rank, world_size = _environment()
    # our own log before anything can print: a crash in an import still lands in it
    log_fd = os.open(log_path(out_dir, rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    faulthandler.enable(all_threads=True)  # fatal signals: every thread's stack to the log
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks before a kill
    template = from_json(ProbeSpec, Path(args.spec).read_text())
    devices = template.params.get("devices") or [None]
    ordinal = devices[local_rank] if local_rank < len(devices) else None
    spec = rank_spec(template, rank, ordinal)
    ctx = RankContext(spec, rank=rank, local_rank=local_rank, world_size=world_size, out_dir=out_dir)
    ctx._write(
        {
            "type": "start",
            "pid": os.getpid(),
            "rank": rank,
            "local_rank": local_rank,
            "world_size": world_size,
            "host": socket.gethostname(),
            "t": time.time(),
        }
    )
    ctx.inject("start")
    outcome = execute(ctx)
    write_result(out_dir, rank, outcome)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if outcome.status is Status.ERROR else 0)


if __name__ == "__main__":
    main()
