"""Standalone repro scripts for the per-rank causes of ``qmoe-doctor repro --parallel``.

One script per cause, run as ``torchrun --standalone --nproc-per-node W SCRIPT``: every rank does
the least its cause needs, on its own, with no collective in the check (a rank that fails cannot
hang the others), prints ``rank R: PASS (...)`` or ``rank R: FAIL (...)``, waits (a CPU barrier,
60 s at most) until every rank has printed, because torchrun stops the other ranks as soon as one
exits non-zero, and exits 0 (pass), 1 (fail: reproduced) or 2 (cannot run here); torchrun reports
the rank that failed.

* ``device-never-set``: rank r puts its operands on cuda:LOCAL_RANK, makes its device current the
  way the kernel's module does (its ``qmoe_set_rank_device`` rank hook, else
  ``torch.cuda.set_device``: the rank code as the doctor ran it), says which device is current,
  calls the kernel and compares with a float32 loop over experts. Needs CUDA.
* ``invalid-routing``: rank r owns experts ``[r * E / W, (r + 1) * E / W)`` of a seeded full
  weight stack, keeps the rows of a seeded routing whose expert it owns, turns their global ids
  into local ones as the kernel's module does (``qmoe_local_expert_ids``, else ``ids - first``),
  sorts and counts them over its ``E / W`` experts (ids outside ``[0, E / W)`` counted under no
  expert, as the doctor's sort does), runs the kernel on its local stack and compares with the
  full stack's experts at the rows' *global* ids. ``--device cpu`` runs it on CPU ranks under the
  Triton interpreter in float32 (the self-test of the script; the doctor's CPU tier is the same).

Built like :mod:`qmoe_doctor.reports.repro_script`: fixed blocks of code, the run's constants written with
``repr``, no templating of logic. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from qmoe_doctor import __version__
from qmoe_doctor.core.causes import get_cause
from qmoe_doctor.core.modes import MODE_OF
from qmoe_doctor.core.records import Diagnosis, Shape
from qmoe_doctor.core.reports import ParallelReport
from qmoe_doctor.reports.repro_script import LOAD_KERNEL, TOLERANCES, doc_safe, script_kernel_ref

DEVICE_NEVER_SET = "device-never-set"
INVALID_ROUTING = "invalid-routing"
#: Causes a script can be written for, in the order they are written.
PARALLEL_SCRIPT_CAUSES = (DEVICE_NEVER_SET, INVALID_ROUTING)
#: Causes whose script runs on CPU ranks too (``--device cpu``).
CPU_CAUSES = frozenset({INVALID_ROUTING})


class UnsupportedCause(ValueError):
    """No per-rank script template for this cause."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelScriptSpec:
    """What one script restates: the cause, the kernel, the operands' shape, the ranks."""

    cause: str
    kernel: str
    shape: Shape  # M rows, E experts, w (E, N, K), dtype (float32 on the CPU tier)
    seed: int
    world: int  # ranks the doctor ran (torchrun --nproc-per-node)
    cause_title: str = ""
    seen: str = ""  # where the doctor saw it: "ep: rank 1 (cuda:1, GPU 3)"
    cuda_visible_devices: str | None = None  # the GPUs the ranks saw, as the doctor set them


def parallel_script_name(cause: str) -> str:
    return f"qmoe-repro-parallel-{cause}.py"


def torchrun_command(
    path: str | Path, world: int, *, cpu: bool = False, cuda_visible_devices: str | None = None
) -> str:
    """The command line that runs a script as the doctor ran its ranks."""
    env = f"CUDA_VISIBLE_DEVICES={cuda_visible_devices} " if cuda_visible_devices and not cpu else ""
    return f"{env}torchrun --standalone --nproc-per-node {world} {path}" + (" --device cpu" if cpu else "")


def render_parallel_script(spec: ParallelScriptSpec, *, tool_version: str = __version__) -> str:
    """The source of a standalone per-rank script for ``spec.cause``."""
    if spec.cause not in PARALLEL_SCRIPT_CAUSES:
        raise UnsupportedCause(
            f"no per-rank script template for {spec.cause!r}; known: {', '.join(PARALLEL_SCRIPT_CAUSES)}"
        )
    if spec.world < 2:
        raise ValueError(f"a per-rank repro needs two ranks or more, got {spec.world}")
    ref, needs_loader = script_kernel_ref(spec.kernel)
    s = spec.shape
    name = parallel_script_name(spec.cause)
    gpu_run = torchrun_command(name, spec.world, cuda_visible_devices=spec.cuda_visible_devices)
    lines = [
        "#!/usr/bin/env python3",
        '"""Standalone per-rank repro written by qmoe-doctor ' + tool_version + ".",
        "",
        f"Cause:   {doc_safe(spec.cause)}" + (f" - {doc_safe(spec.cause_title)}" if spec.cause_title else ""),
        f"Kernel:  {doc_safe(spec.kernel)}",
        f"Seen:    {doc_safe(spec.seen or 'qmoe-doctor repro --parallel')}",
        f"Checks:  {_CAUSE_DOC[spec.cause]}",
        "",
        "Run it with one process per rank, as the doctor ran them:",
        "",
        f"    {gpu_run}",
        "",
    ]
    if spec.cause in CPU_CAUSES:
        lines += [
            "or on CPU ranks (Triton interpreter, float32; slow at large shapes):",
            "",
            f"    {torchrun_command(name, spec.world, cpu=True)}",
            "",
        ]
    lines += [
        "No rank's check talks to another: each prints its own `rank R: PASS/FAIL (...)` line and",
        "exit status (0 PASS, 1 FAIL: reproduced, 2 cannot run here) after a CPU barrier (60 s at",
        "most) that keeps torchrun from stopping a rank before it printed; torchrun names the rank",
        "that failed.",
        "It imports only torch, triton and the kernel"
        + (" (through qmoe-doctor's loader, which this kernel reference needs)" if needs_loader else "")
        + ".",
        '"""',
        _HEADER,
        f"KERNEL = {ref!r}  # module:function or path/to/file.py:function",
        f"USE_QMOE_LOADER = {needs_loader!r}",
        f"CAUSE = {spec.cause!r}",
        f"SCRIPT = {name!r}",
        f"WORLD = {spec.world!r}  # ranks the doctor ran; torchrun's WORLD_SIZE is what counts",
        f"M, E, N, K = {s.m!r}, {s.e!r}, {s.n!r}, {s.k!r}  # x (M, K) rows, w (E, N, K) experts, y (M, N)",
        f"DTYPE = {s.dtype!r}  # on GPUs; float32 on CPU ranks (bf16 tl.dot is broken in the interpreter)",
        f"SEED = {spec.seed!r}",
        f"TOLERANCES = {dict(TOLERANCES)!r}  # ||y - ref|| / ||ref|| against a float32 loop",
        "",
    ]
    return "\n".join(lines) + "\n" + _COMMON + "\n" + _RUN[spec.cause] + "\n" + _MAIN


_CAUSE_DOC = {
    DEVICE_NEVER_SET: (
        "each rank's operands on cuda:LOCAL_RANK, its device made current as the kernel's module "
        "does (qmoe_set_rank_device, else torch.cuda.set_device), the kernel against a float32 loop"
    ),
    INVALID_ROUTING: (
        "each rank's rows remapped to its own E/W experts as the kernel's module does "
        "(qmoe_local_expert_ids, else ids - first), the kernel on the local stack against the full "
        "stack at the global ids"
    ),
}

# Before torch and triton: the interpreter is chosen when triton is imported.
_HEADER = '''
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import math
import os
import sys
from pathlib import Path


def wants_cpu(argv):
    """``--device cpu`` (or ``--device=cpu``) on the command line."""
    return "--device=cpu" in argv or any(a == "--device" and b == "cpu" for a, b in zip(argv, argv[1:]))


if wants_cpu(sys.argv[1:]):
    os.environ["TRITON_INTERPRET"] = "1"  # CPU ranks run Triton kernels in its interpreter

import torch  # noqa: E402
import triton  # noqa: E402,F401  the kernel's runtime: a missing triton fails here, not mid-run
'''

_COMMON = (
    LOAD_KERNEL
    + '''

def module_hook(kernel, name):
    """The rank hook ``name`` of the kernel's module, or None (then the correct default runs)."""
    hook = getattr(inspect.getmodule(kernel), name, None)
    return hook if callable(hook) else None


def rank_env():
    """(global rank, local rank, world size) as torchrun sets them; None outside torchrun."""
    if "LOCAL_RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    local = int(os.environ["LOCAL_RANK"])
    return int(os.environ.get("RANK", local)), local, int(os.environ["WORLD_SIZE"])


def dtype_on(device):
    return torch.float32 if device.type == "cpu" else getattr(torch, DTYPE)


def make_batch(device, dtype):
    """x (M, K), the full stack w (E, N, K) and each row's global expert id: the same in every
    rank (one seeded generator on the device)."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    x = torch.randn((M, K), device=device, dtype=torch.float32, generator=gen).to(dtype)
    w = (torch.randn((E, N, K), device=device, dtype=torch.float32, generator=gen) / math.sqrt(K)).to(dtype)
    ids = torch.randint(0, E, (M,), device=device, generator=gen)
    return x, w, ids


def expert_loop(x, w, ids):
    """float32, one matmul per expert: row i is x[i] @ w[ids[i]].T."""
    y = torch.zeros((x.shape[0], w.shape[1]), dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        rows = ids == expert
        y[rows] = x[rows].float() @ w[expert].float().T
    return y


def sync_all():
    """Synchronize every GPU this process has a CUDA context on (never create one)."""
    if not torch.cuda.is_available():
        return
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    for i in range(torch.cuda.device_count()):
        if has_context is None or has_context(i):
            torch.cuda.synchronize(i)


def judge(y, ref, device, tolerance):
    """(what is wrong with y against ref, its relative error)."""
    if not isinstance(y, torch.Tensor):
        return [f"the kernel returned {type(y).__name__}, not a tensor"], float("inf")
    problems = []
    if y.device != device:
        problems.append(f"output on {y.device}, operands on {device}")
    if tuple(y.shape) != tuple(ref.shape):
        return problems + [f"output shape {tuple(y.shape)}, expected {tuple(ref.shape)}"], float("inf")
    out = y.detach().to(ref.device, torch.float32)
    diff = torch.nan_to_num(out - ref, nan=float("inf"))
    ref_norm = float(ref.norm())
    err = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    if not err <= tolerance:
        problems.append(f"rel. error {err:.3g} > tolerance {tolerance:g}")
    return problems, err
'''
)

_RUN = {
    DEVICE_NEVER_SET: '''
def cannot_run(device_kind, rank, local_rank, world):
    if device_kind == "cpu":
        return "device-never-set is about CUDA's current device, which CPU ranks do not have: run it on GPUs"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        return f"local rank {local_rank} needs cuda:{local_rank}; torch sees {count} CUDA GPU(s)"
    return None


def run(kernel, rank, local_rank, world, device_kind):
    """This rank's operands on its own GPU, its device made current as the rank code does, one call."""
    own = torch.device("cuda", local_rank)
    dtype = dtype_on(own)
    x, w, ids = make_batch(own, dtype)  # operands on cuda:LOCAL_RANK, as model.to(...) puts them
    order = torch.sort(ids, stable=True).indices
    x, ids = x[order].contiguous(), ids[order]
    m_sizes = torch.bincount(ids, minlength=E).to(torch.int32)
    ref = expert_loop(x, w, ids)
    set_device = module_hook(kernel, "qmoe_set_rank_device")
    if set_device is not None:
        set_device(own)  # the kernel module's rank set-up, as the doctor's ranks ran it
        how = "the module's qmoe_set_rank_device"
    else:
        torch.cuda.set_device(own)
        how = "torch.cuda.set_device"
    current = torch.cuda.current_device()
    note = f"current device cuda:{current} after {how}, operands on cuda:{local_rank}"
    print(f"rank {rank}: {note}", flush=True)
    try:
        y = kernel(x, w, m_sizes)
        sync_all()
    except Exception as exc:  # the kernel's own failure is the result (a CUDA error included)
        lines = str(exc).strip().splitlines() or [repr(exc)]
        return [f"{type(exc).__name__}: {lines[0]}"], note
    problems, err = judge(y, ref, own, TOLERANCES[str(dtype).removeprefix("torch.")])
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    for d in range(torch.cuda.device_count()):
        if d == local_rank or (has_context is not None and not has_context(d)):
            continue
        held = torch.cuda.memory_allocated(d)
        if held:
            problems.append(f"torch allocated {held:,} bytes on cuda:{d}, not this rank's GPU")
        else:
            note += f"; a CUDA context on cuda:{d}"
    return problems, f"{note}; rel. error {err:.3g}"
''',
    INVALID_ROUTING: '''
def cannot_run(device_kind, rank, local_rank, world):
    if E % world:
        return f"{E} experts do not split evenly over {world} ranks (use --nproc-per-node {WORLD})"
    if device_kind == "cpu":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        return (
            f"local rank {local_rank} needs cuda:{local_rank}; torch sees {count} CUDA GPU(s) "
            "(--device cpu runs the ranks on the CPU)"
        )
    return None


def run(kernel, rank, local_rank, world, device_kind):
    """This rank's experts, the rows routed to them, their local ids as the rank code makes them."""
    device = torch.device("cpu") if device_kind == "cpu" else torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # set up right: this script is about the expert ids
    dtype = dtype_on(device)
    per = E // world
    first = rank * per
    x_all, w_full, ids = make_batch(device, dtype)
    mine = torch.div(ids, per, rounding_mode="floor") == rank  # what the all-to-all delivers here
    x, global_ids = x_all[mine], ids[mine]
    remap = module_hook(kernel, "qmoe_local_expert_ids")
    local_ids = remap(global_ids, first, per) if remap is not None else global_ids - first
    local_ids = local_ids.to(torch.int64)
    bad = (local_ids < 0) | (local_ids >= per)
    key = torch.where(bad, torch.full_like(local_ids, per), local_ids)  # bad ids: under no expert
    order = torch.sort(key, stable=True).indices
    m_sizes = torch.bincount(key, minlength=per + 1)[:per].to(torch.int32)
    xs, gs = x[order].contiguous(), global_ids[order]
    w_local = w_full[first : first + per].contiguous()
    y = kernel(xs, w_local, m_sizes)
    sync_all()
    ref = expert_loop(xs, w_full, gs)  # each row by its expert of the full stack, at its global id
    problems, err = judge(y, ref, device, TOLERANCES[str(dtype).removeprefix("torch.")])
    n_bad = int(bad.sum())
    if n_bad:
        i = int(torch.nonzero(bad[order])[0])  # the first row with a bad id, in sorted order
        example = f"global {int(gs[i])} -> local {int(local_ids[order][i])}"
        problems.insert(
            0,
            f"{n_bad} of {len(gs)} rows carry local expert ids outside [0, {per}) (e.g. {example}): "
            "global ids reached the local weight stack",
        )
    detail = (
        f"experts [{first}, {first + per}) of {E}, {len(gs)} rows, {n_bad} local id(s) out of range, "
        f"rel. error {err:.3g}, {device} {str(dtype).removeprefix('torch.')}"
    )
    return problems, detail
''',
}

_MAIN = """
def wait_for_ranks(rank, world, timeout_s=60):
    \"\"\"Hold this rank's exit until every rank has printed its verdict: torchrun stops the other
    ranks as soon as one exits non-zero, which would lose their lines. A CPU (gloo) barrier over
    torchrun's store, bounded, so that a rank that died cannot hang the others.\"\"\"
    if world < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # a rank that never arrived: exit anyway
        print(f"rank {rank}: (did not wait for every rank: {type(exc).__name__})", file=sys.stderr, flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=f"{CAUSE}: one rank of the repro; run under torchrun.")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cuda: rank r on cuda:LOCAL_RANK (default); cpu: CPU ranks, the Triton interpreter, float32",
    )
    args = parser.parse_args(argv)
    ranks = rank_env()
    if ranks is None:
        print(f"SKIP: run me with one process per rank: torchrun --standalone --nproc-per-node {WORLD} {SCRIPT}")
        return 2
    status = verdict(args.device, *ranks)
    wait_for_ranks(ranks[0], ranks[2])
    return status


def verdict(device, rank, local_rank, world):
    \"\"\"This rank's check, printed as one line: 0 PASS, 1 FAIL (reproduced), 2 cannot run here.\"\"\"
    if world < 2:
        print(f"rank {rank}: SKIP: needs two ranks or more (--nproc-per-node {WORLD})")
        return 2
    why = cannot_run(device, rank, local_rank, world)
    if why:
        print(f"rank {rank}: SKIP: {why}")
        return 2
    kernel = load_kernel(KERNEL)
    try:
        problems, detail = run(kernel, rank, local_rank, world, device)
    except Exception as exc:  # the kernel's own failure is the result (a CUDA error included)
        lines = str(exc).strip().splitlines() or [repr(exc)]
        print(f"rank {rank}: FAIL ({type(exc).__name__}: {lines[0]})", flush=True)
        return 1
    if problems:
        print(f"rank {rank}: FAIL ({'; '.join(problems)}; {detail})", flush=True)
        return 1
    print(f"rank {rank}: PASS ({detail})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
"""


def script_specs(report: ParallelReport) -> list[ParallelScriptSpec]:
    """One spec per scriptable cause among the report's diagnoses (a cause diagnosed under
    several modes gets one script: the ranks' code is the same), with the shape, seed and
    ranks of the torchrun launch that showed it first (the report's ``ModeResult``)."""
    specs: list[ParallelScriptSpec] = []
    launched = [(m, m.shape) for m in report.modes if m.torchrun and m.shape is not None]
    for cause in PARALLEL_SCRIPT_CAUSES:
        found = [d for d in report.diagnoses if d.cause == cause]
        if not found or not launched:
            continue
        modes = [MODE_OF[e.condition] for d in found for e in d.evidence if e.condition in MODE_OF]
        run, shape = next(((r, s) for r, s in launched if r.mode in modes), launched[0])
        seen = "; ".join(_seen(d) for d in found)
        try:
            title = get_cause(cause).title
        except KeyError:
            title = ""
        specs.append(
            ParallelScriptSpec(
                cause=cause,
                kernel=report.kernel,
                shape=shape,
                seed=run.seed,
                world=run.nproc,
                cause_title=title,
                seen=seen,
                cuda_visible_devices=run.cuda_visible_devices if report.tier == "gpu" else None,
            )
        )
    return specs


def _seen(d: Diagnosis) -> str:
    """``"ep: rank 1 (cuda:1, GPU 3)"``: the mode and the ranks a diagnosis names."""
    mode = next((MODE_OF[e.condition].value for e in d.evidence if e.condition in MODE_OF), None)
    where = ", ".join(d.where) or "some rank"
    return f"{mode}: {where}" if mode else where


@dataclass(frozen=True, slots=True, kw_only=True)
class WrittenScript:
    cause: str
    path: str
    command: str  # how to run it here: on the tier the doctor ran (GPUs, or CPU ranks)
    gpu_command: str  # on GPUs, one rank per GPU
    cpu_command: str | None = None  # on CPU ranks, where the cause can show there


def write_parallel_scripts(
    specs: Sequence[ParallelScriptSpec], out_dir: Path, *, cpu_tier: bool = False
) -> list[WrittenScript]:
    """Write one script per spec into ``out_dir`` (made if missing), executable."""
    if specs:
        out_dir.mkdir(parents=True, exist_ok=True)
    written: list[WrittenScript] = []
    for spec in specs:
        path = out_dir / parallel_script_name(spec.cause)
        path.write_text(render_parallel_script(spec), encoding="utf-8")
        with contextlib.suppress(OSError):
            path.chmod(0o755)
        gpu = torchrun_command(path, spec.world, cuda_visible_devices=spec.cuda_visible_devices)
        cpu = torchrun_command(path, spec.world, cpu=True) if spec.cause in CPU_CAUSES else None
        written.append(
            WrittenScript(
                cause=spec.cause,
                path=str(path),
                command=cpu if cpu_tier and cpu else gpu,
                gpu_command=gpu,
                cpu_command=cpu,
            )
        )
    return written


__all__ = [
    "CPU_CAUSES",
    "PARALLEL_SCRIPT_CAUSES",
    "ParallelScriptSpec",
    "UnsupportedCause",
    "WrittenScript",
    "parallel_script_name",
    "render_parallel_script",
    "script_specs",
    "torchrun_command",
    "write_parallel_scripts",
]
