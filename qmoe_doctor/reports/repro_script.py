"""Standalone repro scripts: one probe's condition as plain code (``qmoe-doctor repro`` writes one).

A script imports only torch, triton and the kernel under test, sets up exactly the condition the
minimal failing probe set up (operands on GPU B, GPU A touched, peer access A -> B enabled by one
copy, a producer queued behind a 0.2 s hold of B's stream, the kernel called with A
current, ...), synchronizes, compares with a float32 loop over experts, prints ``PASS`` or
``FAIL`` and exits 0 (pass), 1 (fail: reproduced) or 2 (cannot run here: too few GPUs).

The script is built from fixed blocks of code (no templating of logic): a docstring, the
constants of the run (shape, seed, routing, ordinals, written with ``repr``), the shared helpers,
and one ``run(kernel)`` per condition. Nothing here imports torch.
"""

from __future__ import annotations

from qmoe_doctor import __version__
from qmoe_doctor.core.kernel_ref import KernelRef
from qmoe_doctor.core.records import PAIR_CONDITIONS, Condition, ProbeSpec

#: Conditions a script can be written for (the ones the repro shrink can end on, and a few more).
PAIR_SCRIPT_CONDITIONS = PAIR_CONDITIONS  # every pair condition
SINGLE_SCRIPT_CONDITIONS = frozenset(
    {
        Condition.SINGLE,
        Condition.REPEAT_CALL,
        Condition.SIDE_STREAM,
        Condition.OVER_ROUTED,
        Condition.NEGATIVE_SIZES,
        Condition.INT32_BOUNDARY,
    }
)
SCRIPT_CONDITIONS = PAIR_SCRIPT_CONDITIONS | SINGLE_SCRIPT_CONDITIONS

# Values the probes use (probes/conditions.py), restated so the script stands alone.
HOLD_S = 0.2  # the producer's wait (probes/conditions.py HOLD_S): still queued at the call
FALLBACK_HZ = 1.98e9  # the hold's torch.cuda._sleep cycles a second (probes/stream_hold.py)
STALE_SIZE = 1 << 20  # what a recycled m_sizes block holds before its producer runs
TOLERANCES = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 2e-3}  # qmoe_doctor.core.tolerances


class UnsupportedCondition(ValueError):
    """No script template for this condition."""


def script_kernel_ref(kernel: str) -> tuple[str, bool]:
    """The reference the script imports, and whether it needs qmoe-doctor's own loader
    (an adapter has no plain ``module:function`` of the user's). File paths are made absolute:
    the script may run from another folder."""
    ref = KernelRef.parse(kernel)
    plain = ref.standalone()
    if plain is None:
        return str(ref.absolute()), True
    return str(plain), False


def script_name(cause: str | None, condition: Condition) -> str:
    """``qmoe-repro-<cause>.py``, or ``qmoe-repro-<condition>.py`` when no cause was named."""
    return f"qmoe-repro-{cause or condition.value}.py"


def doc_safe(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"""', "'''")


def render_script(
    spec: ProbeSpec,
    *,
    cause: str | None = None,
    cause_title: str = "",
    gpus: tuple[int, int] | None = None,
    cuda_visible_devices: str | None = None,
    tool_version: str = __version__,
) -> str:
    """The source of a standalone script that reproduces ``spec``'s condition."""
    cond = spec.condition
    if cond not in SCRIPT_CONDITIONS:
        raise UnsupportedCondition(f"no script template for the {cond.value} condition")
    pair = cond in PAIR_SCRIPT_CONDITIONS
    ref, needs_loader = script_kernel_ref(spec.kernel)
    s = spec.shape
    name = script_name(cause, cond)
    visible = [v for v in (cuda_visible_devices or "").split(",") if v]
    if pair:
        seen = f"GPU {gpus[0]} current, operands on GPU {gpus[1]} (NVML numbering)" if gpus else "two GPUs"
        as_run = f"CUDA_VISIBLE_DEVICES={','.join(visible[:2])} " if len(visible) >= 2 else ""
        devices_doc = "two CUDA GPUs: ordinal A is current at the call, the operands live on ordinal B"
    else:
        seen = f"GPU {gpus[1]} (NVML numbering)" if gpus else "one GPU"
        as_run = f"CUDA_VISIBLE_DEVICES={visible[-1]} " if visible else ""
        devices_doc = "one CUDA GPU (ordinal D)"
    lines = [
        "#!/usr/bin/env python3",
        '"""Standalone repro written by qmoe-doctor ' + tool_version + ".",
        "",
        f"Cause:     {doc_safe(cause or 'none named')}"
        + (f" - {doc_safe(cause_title)}" if cause_title else ""),
        f"Condition: {cond.value} - {_CONDITION_DOC[cond]}",
        f"Kernel:    {doc_safe(spec.kernel)}",
        f"Seen on:   {seen}",
        "",
        f"Needs {devices_doc}. Run it as it ran:",
        "",
        f"    {as_run}python {name}",
        "",
        "or with CUDA_VISIBLE_DEVICES naming any GPUs of yours. It imports only torch, triton and",
        "the kernel"
        + (" (through qmoe-doctor's loader, which this kernel reference needs)" if needs_loader else "")
        + ". Exit status: 0 PASS, 1 FAIL (reproduced), 2 cannot run here.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import importlib",
        "import importlib.util",
        "import math",
        "import sys",
        "import time",
        "from pathlib import Path",
        "",
        "import torch",
        "import triton  # the kernel's runtime (a missing triton fails here, not mid-run) and the stream hold",
        "",
        f"KERNEL = {ref!r}  # module:function or path/to/file.py:function",
        f"USE_QMOE_LOADER = {needs_loader!r}",
        f"CONDITION = {cond.value!r}",
    ]
    if pair:
        lines.append("A, B = 0, 1  # CUDA ordinals: A is current at the call, the operands live on B")
        lines.append("NEED_GPUS = 2")
    else:
        lines.append("D = 0  # CUDA ordinal of the one GPU")
        lines.append("NEED_GPUS = 1")
    lines += [
        f"M, E, N, K = {s.m!r}, {s.e!r}, {s.n!r}, {s.k!r}  # x (M, K), w (E, N, K), y (M, N)",
        f"DTYPE = torch.{s.dtype}",
        f"ROUTING = {s.routing!r}  # how the M rows spread over the E experts",
        f"SEED = {spec.seed!r}",
        f"TOLERANCE = {TOLERANCES[s.dtype]!r}  # ||y - ref|| / ||ref|| against a float32 loop",
        f"HOLD_S = {HOLD_S!r}  # seconds the stream waits before the producer: still queued at the call",
        f"FALLBACK_HZ = {FALLBACK_HZ!r}  # a Triton without globaltimer: torch.cuda._sleep cycles a second",
        f"STALE_SIZE = {STALE_SIZE!r}  # what a recycled m_sizes block holds before its producer runs",
        f"EXTRA_ROWS = {int(spec.params.get('extra_rows', 64))!r}  # over-routed: rows m_sizes claims past M",
        "",
    ]
    return "\n".join(lines) + "\n" + _COMMON + "\n" + _RUN[cond] + "\n" + _MAIN


_CONDITION_DOC = {
    Condition.SINGLE: "operands and the current device on one GPU (the baseline)",
    Condition.REPEAT_CALL: "the first and second call of a fresh process on identical inputs",
    Condition.SIDE_STREAM: "the caller works on a side stream, x's producer still queued on it",
    Condition.OVER_ROUTED: "m_sizes sums past M (rows that do not exist); a canary after y",
    Condition.NEGATIVE_SIZES: "a -1 sentinel count in m_sizes",
    Condition.INT32_BOUNDARY: "rows routed to the first expert whose offset passes 2**31 elements",
    Condition.GUARDED: "operands on B, B current (the guarded baseline)",
    Condition.UNTOUCHED: "operands on B, A current, no CUDA context ever made on A",
    Condition.NO_PEER: "operands on B, A current and touched, peer access A -> B off",
    Condition.PEER: "operands on B, A current, peer access A -> B on (one copy A -> B)",
    Condition.PRODUCER_RACE: "as peer, with x still being written on B's stream",
    Condition.SIZES_RACE: "as peer, with m_sizes still being written on B's stream (stale values)",
}

# The script's kernel loader (also the per-rank scripts', parallel_script.py). A script stands
# alone, so it carries its own few lines: KERNEL is always a plain reference rendered by
# script_kernel_ref (module:function or an absolute file.py:function), or an adapter reference
# handed to qmoe-doctor's loader.
LOAD_KERNEL = '''
def load_kernel(ref):
    """``module:function`` or ``/path/to/file.py:function``."""
    if USE_QMOE_LOADER:
        from qmoe_doctor.probes.loader import load_kernel as qmoe_load

        return qmoe_load(ref)
    where, _, name = ref.rpartition(":")
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        spec = importlib.util.spec_from_file_location(f"repro_kernel_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # triton.jit reads the source through the module
        sys.path.insert(0, str(path.resolve().parent))  # the file's sibling imports
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)
'''

_COMMON = (
    LOAD_KERNEL
    + '''

def routing_sizes():
    """Rows per expert, deterministic from SEED (the probes' own patterns)."""
    if ROUTING == "uniform":
        sizes = [M // E] * E
        for i in range(M - sum(sizes)):
            sizes[i] += 1
        return sizes
    if ROUTING == "hot-expert":
        return [M if i == E // 2 else 0 for i in range(E)]
    if ROUTING == "last-expert":
        return [0] * (E - 1) + [M]
    if ROUTING.startswith("expert:"):
        hot = int(ROUTING.split(":", 1)[1])
        return [M if i == hot else 0 for i in range(E)]
    gen = torch.Generator().manual_seed(SEED + 7)
    if ROUTING == "empty-experts":  # every other expert empty
        weights = torch.tensor([0.0 if i % 2 else 1.0 for i in range(E)])
    else:  # "random": skewed like real routers
        weights = torch.rand(E, generator=gen) ** 2 + 0.01
    ids = torch.multinomial(weights, M, replacement=True, generator=gen)
    return torch.bincount(ids, minlength=E).tolist()


SIZES = routing_sizes()


def make_operands(device):
    """x (M, K), w (E, N, K), m_sizes (E,) int32, made on ``device`` only (no copies)."""
    gen = torch.Generator(device=device).manual_seed(SEED)
    x = torch.randn((M, K), device=device, dtype=torch.float32, generator=gen).to(DTYPE)
    w = (torch.randn((E, N, K), device=device, dtype=torch.float32, generator=gen) / math.sqrt(K)).to(DTYPE)
    m_sizes = torch.tensor(SIZES, dtype=torch.int32, device=device)
    return x, w, m_sizes


def reference(x, w, sizes):
    """float32 loop over experts: y[rows of e] = x[rows of e] @ w[e].T. Counts below 0 are 0
    and nothing runs past row M, as a correct kernel masks them."""
    y = torch.zeros((x.shape[0], w.shape[1]), dtype=torch.float32, device=x.device)
    row = 0
    for expert, size in enumerate(sizes):
        size = min(max(int(size), 0), max(x.shape[0] - row, 0))
        if size:
            y[row : row + size] = x[row : row + size].float() @ w[expert].float().T
        row += size
    return y


def sync_all():
    """Synchronize every GPU that has a CUDA context (never create one)."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    for i in range(torch.cuda.device_count()):
        if has_context is None or has_context(i):
            torch.cuda.synchronize(i)


try:
    from triton.language.extra.cuda import globaltimer
except ImportError:  # a Triton without it: torch.cuda._sleep below
    _hold = None
else:

    @triton.jit
    def _hold(ns):
        """One thread spins until the GPU's nanosecond clock has moved ``ns``."""
        start = globaltimer()
        now = start
        while now - start < ns:
            now = globaltimer()


def hold_stream(seconds):
    """Queue ``seconds`` of waiting on the current stream. A spin on the GPU's global clock: the
    cycle counter torch.cuda._sleep spins on belongs to one SM, and a spin moved to another SM by
    a card shared with other processes ends much later or at once."""
    if _hold is None:
        torch.cuda._sleep(int(seconds * FALLBACK_HZ))
    else:
        _hold[(1,)](int(seconds * 1e9), num_warps=1)


def touch(device):
    """Make ``device`` current and create its context, as any earlier use of it does."""
    torch.cuda.set_device(device)
    torch.ones(1, device=device).add_(1)


def enable_peer(src, dst):
    """One copy src -> dst, as every device_map pipeline does: torch turns on src's access to dst."""
    torch.ones(256, device=src).to(dst)
    sync_all()


def judge(y, ref, device):
    """What is wrong with y against ref (empty: nothing)."""
    if not isinstance(y, torch.Tensor):
        return [f"the kernel returned {type(y).__name__}, not a tensor"]
    problems = []
    if y.device != device:
        problems.append(f"output on {y.device}, operands on {device}")
    if tuple(y.shape) != tuple(ref.shape):
        return problems + [f"output shape {tuple(y.shape)}, expected {tuple(ref.shape)}"]
    out = y.detach().to(ref.device, torch.float32)
    unwritten = int((torch.isnan(out) & torch.isfinite(ref)).sum())
    diff = torch.nan_to_num(out - ref, nan=float("inf"))
    ref_norm = float(ref.norm())
    err = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    print(f"rel. error {err:.3g} (tolerance {TOLERANCE:g})")
    if unwritten:
        problems.append(f"{unwritten} output elements NaN (never written, or computed from stale input)")
    if not err <= TOLERANCE:
        problems.append(f"rel. error {err:.3g} > tolerance {TOLERANCE:g}")
    return problems


def time_calls(fn, repeats=10):
    """Median wall time of one call (ms), each followed by a synchronize of every GPU."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync_all()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


class OutputTrap:
    """Poison the block the kernel's output will get, with a canary block right after it.

    The caching allocator gives a freed block of the same size to the next allocation on the
    same stream, so the kernel's ``torch.empty`` output starts as NaN (unwritten rows show) and
    a write past the end of y lands in the canary. Whether y got that block is checked."""

    def __init__(self, nbytes, device):
        hole = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)  # NaN in every float dtype
        self.canary = None
        self.hole_ptr = hole.data_ptr()
        if nbytes < (10 << 20):  # larger blocks get a segment of their own: nothing follows them
            size = 64 * 1024 if nbytes < (1 << 20) else (1 << 20) + 512  # from y's pool
            self.canary = torch.full((size,), 0xA5, dtype=torch.uint8, device=device)
        self.adjacent = self.canary is not None and self.canary.data_ptr() == self.hole_ptr + (nbytes + 511) // 512 * 512
        del hole  # back to the pool, NaN inside

    def report(self, y):
        if self.canary is None or not isinstance(y, torch.Tensor) or y.data_ptr() != self.hole_ptr or not self.adjacent:
            print("note: the canary could not be placed right after y; writes past y go unseen")
            return []
        if bool((self.canary != 0xA5).any()):
            return ["the kernel wrote past the end of y (canary overwritten)"]
        return []
'''
)

_RUN: dict[Condition, str] = {
    Condition.GUARDED: """
def run(kernel):
    b = torch.device("cuda", B)
    x, w, m_sizes = make_operands(b)
    ref = reference(x, w, SIZES)
    with torch.cuda.device(b):  # the operand GPU is current: the guarded baseline
        y = kernel(x, w, m_sizes)
    sync_all()
    return judge(y, ref, b)
""",
    Condition.UNTOUCHED: """
def run(kernel):
    # A is the process's default device (ordinal 0) and nothing here touches it: no CUDA context
    # exists on A at the call. An unguarded launch then runs in B's context by accident; any
    # earlier use of A (a copy, a tensor, set_device) breaks that.
    assert A == 0, "only the default device can be current without a context"
    b = torch.device("cuda", B)
    x, w, m_sizes = make_operands(b)  # creates B's context only
    ref = reference(x, w, SIZES)
    y = kernel(x, w, m_sizes)
    sync_all()
    return judge(y, ref, b)
""",
    Condition.NO_PEER: """
def run(kernel):
    a, b = torch.device("cuda", A), torch.device("cuda", B)
    x, w, m_sizes = make_operands(b)
    ref = reference(x, w, SIZES)
    touch(a)  # A current, its context made; peer access A -> B still off
    y = kernel(x, w, m_sizes)
    sync_all()
    return judge(y, ref, b)
""",
    Condition.PEER: """
def run(kernel):
    a, b = torch.device("cuda", A), torch.device("cuda", B)
    x, w, m_sizes = make_operands(b)
    ref = reference(x, w, SIZES)
    touch(a)
    enable_peer(a, b)  # peer access A -> B on, as after any device_map pipeline's first copy
    y = kernel(x, w, m_sizes)  # A current
    sync_all()
    problems = judge(y, ref, b)
    if not problems:
        remote = time_calls(lambda: kernel(x, w, m_sizes))
        with torch.cuda.device(b):
            local = time_calls(lambda: kernel(x, w, m_sizes))
        print(f"{remote:.3f} ms with A current, {local:.3f} ms with B current ({remote / local:.1f}x): "
              "several times slower means the kernel ran on A, reading B's memory remotely")
    return problems
""",
    Condition.PRODUCER_RACE: """
def run(kernel):
    a, b = torch.device("cuda", A), torch.device("cuda", B)
    x_src, w, m_sizes = make_operands(b)
    ref = reference(x_src, w, SIZES)
    touch(a)
    enable_peer(a, b)
    kernel(x_src, w, m_sizes)  # warm-up: compile before the race, or the hold runs out
    sync_all()
    with torch.cuda.device(b):
        x = torch.full_like(x_src, float("nan"))  # what x holds before its producer runs
        sync_all()
        hold_stream(HOLD_S)  # B's current stream is busy ...
        x.copy_(x_src)  # ... and x's producer is queued behind it
    y = kernel(x, w, m_sizes)  # A current: a launch on A's stream is not ordered after the copy
    sync_all()
    return judge(y, ref, b)
""",
    Condition.SIZES_RACE: """
def run(kernel):
    a, b = torch.device("cuda", A), torch.device("cuda", B)
    x, w, m_src = make_operands(b)
    ref = reference(x, w, SIZES)
    touch(a)
    enable_peer(a, b)
    kernel(x, w, m_src)  # warm-up: compile before the race, or the hold runs out
    sync_all()
    with torch.cuda.device(b):
        m_sizes = torch.full_like(m_src, STALE_SIZE)  # a recycled block's stale counts
        sync_all()
        hold_stream(HOLD_S)  # B's current stream is busy ...
        m_sizes.copy_(m_src)  # ... and m_sizes' producer is queued behind it
    y = kernel(x, w, m_sizes)  # A current: may read the stale counts (an illegal access)
    sync_all()
    return judge(y, ref, b)
""",
    Condition.SINGLE: """
def run(kernel):
    d = torch.device("cuda", D)
    x, w, m_sizes = make_operands(d)
    ref = reference(x, w, SIZES)
    with torch.cuda.device(d):
        y = kernel(x, w, m_sizes)
    sync_all()
    return judge(y, ref, d)
""",
    Condition.REPEAT_CALL: """
def run(kernel):
    # the first kernel call of this process: an autotuner benchmarks its configs on it
    d = torch.device("cuda", D)
    x, w, m_sizes = make_operands(d)
    ref = reference(x, w, SIZES)
    results = []
    for call in (1, 2):
        with torch.cuda.device(d):
            y = kernel(x, w, m_sizes)
        sync_all()
        print(f"call {call}: ", end="")
        results.append(judge(y, ref, d))
    if results[0] and not results[1]:
        return ["the first call of the process is wrong and the second, on the same inputs, right: "
                + "; ".join(results[0])]
    return results[0] + results[1]
""",
    Condition.SIDE_STREAM: """
def run(kernel):
    d = torch.device("cuda", D)
    x_src, w, m_sizes = make_operands(d)
    ref = reference(x_src, w, SIZES)
    with torch.cuda.device(d):
        kernel(x_src, w, m_sizes)  # warm-up: compile before the race, or the hold runs out
        sync_all()
        side = torch.cuda.Stream(d)
        with torch.cuda.stream(side):  # the caller's current stream is a side stream
            x = torch.full_like(x_src, float("nan"))
            hold_stream(HOLD_S)
            x.copy_(x_src)  # x's producer, queued on the side stream behind the hold
            y = kernel(x, w, m_sizes)  # must launch on the caller's current stream
    sync_all()
    return judge(y, ref, d)
""",
    Condition.OVER_ROUTED: """
def run(kernel):
    d = torch.device("cuda", D)
    x_valid, w, m_valid = make_operands(d)
    with torch.cuda.device(d):
        backing = torch.full((M + EXTRA_ROWS, K), float("nan"), dtype=DTYPE, device=d)
        backing[:M] = x_valid
        x = backing[:M]  # rows past M hold NaN: a kernel that reads them shows it
        sizes = list(SIZES)
        sizes[-1] += EXTRA_ROWS  # the last expert claims rows that do not exist
        over = torch.tensor(sizes, dtype=torch.int32, device=d)
        ref = reference(x, w, sizes)  # rows past M do not exist
        trap = OutputTrap(M * N * torch.empty((), dtype=DTYPE).element_size(), d)
        y = kernel(x, w, over)
    sync_all()
    return judge(y, ref, d) + trap.report(y)
""",
    Condition.NEGATIVE_SIZES: """
def run(kernel):
    d = torch.device("cuda", D)
    x, w, _ = make_operands(d)
    sizes = list(SIZES)
    j = max(0, len(sizes) // 2 - 1)
    sizes[j + 1] += sizes[j] + 1  # expert j's rows move on, and the counts sum to M + 1
    sizes[j] = -1  # a -1 sentinel (dropped tokens, padding)
    with torch.cuda.device(d):
        m_sizes = torch.tensor(sizes, dtype=torch.int32, device=d)
        ref = reference(x, w, sizes)
        trap = OutputTrap(M * N * torch.empty((), dtype=DTYPE).element_size(), d)
        y = kernel(x, w, m_sizes)
    sync_all()
    return judge(y, ref, d) + trap.report(y)
""",
    Condition.INT32_BOUNDARY: """
def run(kernel):
    # E experts of N x K: the last one is the first whose base offset e * N * K passes 2**31 - 1
    d = torch.device("cuda", D)
    gen = torch.Generator(device=d).manual_seed(SEED)
    hot = E - 1
    print(f"expert {hot} starts at element {hot * N * K:,} (2**31 - 1 = {2**31 - 1:,})")
    x = torch.randn((M, K), device=d, generator=gen).to(DTYPE)
    w = torch.empty((E, N, K), device=d, dtype=DTYPE)
    w[1:hot].fill_(float("nan"))  # a wrapped pointer that lands in another expert reads NaN
    for expert in (0, hot):
        w[expert] = (torch.randn((N, K), device=d, generator=gen) / math.sqrt(K)).to(DTYPE)
    m_sizes = torch.zeros(E, dtype=torch.int32, device=d)
    m_sizes[hot] = M  # every row on the first expert past the boundary
    ref = x.float() @ w[hot].float().T
    with torch.cuda.device(d):
        y = kernel(x, w, m_sizes)
    sync_all()
    return judge(y, ref, d)
""",
}

_MAIN = """
def main():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < NEED_GPUS:
        print(f"SKIP: this repro needs {NEED_GPUS} CUDA GPU(s); torch sees {count}")
        return 2
    kernel = load_kernel(KERNEL)
    print(f"{CONDITION}: {KERNEL} on x ({M}, {K}), w ({E}, {N}, {K}), {DTYPE}")
    try:
        problems = run(kernel)
    except Exception as exc:  # the kernel's own failure is the result (a CUDA error included)
        lines = str(exc).strip().splitlines() or [repr(exc)]
        print(f"FAIL: {type(exc).__name__}: {lines[0]}")
        return 1
    if problems:
        print("FAIL: " + "; ".join(problems))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
"""


__all__ = [
    "SCRIPT_CONDITIONS",
    "UnsupportedCondition",
    "render_script",
    "script_kernel_ref",
    "script_name",
]
