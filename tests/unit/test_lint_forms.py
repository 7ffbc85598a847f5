"""The lint on the launch forms real kernels use, and on the device state such kernels read.

Fixtures come in pairs (tests/fixtures/lint/launch_forms/, hand-written): ``<form>.py`` marks each
fault with ``# FAULT: <rule>`` on the line the lint must report, and ``<form>_guarded.py`` is its
twin with the guard (or the device) right, where the lint must report nothing. Beyond the twins
written by hand, every faulty form is guarded again in each of the usual ways by rewriting its
source (``GUARDS``): the rules must fall silent on twins nobody wrote for them.
"""

from __future__ import annotations

import ast
import re
import shutil
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from qmoe_doctor.lint import LintFinding, Rule, lint_paths, lint_source

REPO = Path(__file__).resolve().parents[2]
FORMS_DIR = REPO / "tests" / "fixtures" / "lint" / "launch_forms"
FAULT_MARK = re.compile(r"#\s*FAULT:\s*([a-z0-9, -]+)")
#: The rules about the device a launch and its state belong to (a guard fixes each of them).
DEVICE_RULES = (
    Rule.UNGUARDED_LAUNCH,
    Rule.DEFAULT_DEVICE_ALLOC,
    Rule.CURRENT_DEVICE_PROPERTY,
    Rule.CACHED_DEVICE_PROPERTY,
    Rule.STREAM_WITHOUT_DEVICE,
)

# (form, what it covers): each has <form>.py and <form>_guarded.py
FORMS = [
    ("conditional_local", "fn = kernel_ws if ws else kernel; fn[grid](...)"),
    ("if_else_local", "a local bound to one of two kernels in an if/else, launched in a helper"),
    ("dict_lookup", "KERNELS[key][grid](...) and KERNELS.get(key, default)[grid](...)"),
    ("getattr_lookup", "getattr(kernels_module, name)[grid](...), the name built at run time or constant"),
    ("run_method", "kernel.run(..., grid=grid, warmup=False)"),
    ("stored_launcher", "launch = kernel[grid]; launch(...)"),
    ("scratch_allocator", 'triton.set_allocator(lambda ...: torch.empty(..., device="cuda")) + a TMA kernel'),
    ("sm_count_grid", 'get_device_properties("cuda").multi_processor_count sizing a persistent grid'),
    ("current_device_constexpr", "get_device_properties(current_device()), get_device_capability() as constexpr"),
]


def _expected(path: Path) -> set[tuple[int, str]]:
    out: set[tuple[int, str]] = set()
    for i, line in enumerate(path.read_text().splitlines(), 1):
        hit = FAULT_MARK.search(line)
        if hit:
            out |= {(i, rule.strip()) for rule in hit.group(1).split(",") if rule.strip()}
    return out


def _found(findings: tuple[LintFinding, ...]) -> set[tuple[int, str]]:
    return {(f.line, f.rule.value) for f in findings}


@pytest.mark.parametrize(("form", "edge"), FORMS, ids=[f for f, _ in FORMS])
def test_each_form_fires_on_its_marked_lines(form: str, edge: str) -> None:
    path = FORMS_DIR / f"{form}.py"
    report = lint_paths([path])
    assert report.errors == ()
    assert _expected(path), f"{form}: no FAULT marker"
    assert _found(report.findings) == _expected(path), (edge, [f.as_line() for f in report.findings])


@pytest.mark.parametrize(("form", "edge"), FORMS, ids=[f for f, _ in FORMS])
def test_each_guarded_twin_is_clean(form: str, edge: str) -> None:
    report = lint_paths([FORMS_DIR / f"{form}_guarded.py"])
    assert report.errors == () and report.findings == (), (edge, [f.as_line() for f in report.findings])


def test_every_fixture_of_the_folder_is_in_the_table() -> None:
    names = {p.stem for p in FORMS_DIR.glob("*.py")} - {"kernels_lib"}
    assert names == {f for f, _ in FORMS} | {f"{f}_guarded" for f, _ in FORMS}


# --- twins nobody wrote: each faulty form guarded again by rewriting its public functions ---


def _entries(tree: ast.Module) -> list[ast.FunctionDef]:
    """The public functions of a fixture (what a user calls): not jit, no leading underscore."""
    return [
        n
        for n in tree.body
        if isinstance(n, ast.FunctionDef) and not n.name.startswith("_") and not n.decorator_list and n.args.args
    ]


def _with(item: str) -> Callable[[ast.FunctionDef], list[ast.stmt]]:
    def guard(func: ast.FunctionDef) -> list[ast.stmt]:
        tensor = func.args.args[0].arg
        head = ast.parse(f"with {item.format(t=tensor)}:\n    pass").body[0]
        assert isinstance(head, ast.With)
        head.body = func.body
        func.body = [head]
        return [func]

    return guard


def _set_device_first(func: ast.FunctionDef) -> list[ast.stmt]:
    func.body = [*ast.parse(f"torch.cuda.set_device({func.args.args[0].arg}.device)").body, *func.body]
    return [func]


def _caller_holds_it(func: ast.FunctionDef) -> list[ast.stmt]:
    """``f`` becomes ``_f_unguarded``, called by a new ``f`` under the guard."""
    name, tensor = func.name, func.args.args[0].arg
    func.name = f"_{name}_unguarded"
    caller = ast.parse(
        f"def {name}({tensor}, *args, **kwargs):\n"
        f"    with torch.cuda.device({tensor}.device):\n"
        f"        return _{name}_unguarded({tensor}, *args, **kwargs)\n"
    ).body
    return [func, *caller]


def _guard_in_a_local(func: ast.FunctionDef) -> list[ast.stmt]:
    """``guard = torch.cuda.device(t.device)`` first, then ``with guard:`` around the body."""
    tensor = func.args.args[0].arg
    head = ast.parse(f"guard = torch.cuda.device({tensor}.device)\nwith guard:\n    pass").body
    assert isinstance(head[1], ast.With)
    head[1].body = func.body
    func.body = head
    return [func]


GUARDS: dict[str, Callable[[ast.FunctionDef], list[ast.stmt]]] = {
    "with torch.cuda.device(t.device) if t.is_cuda else nullcontext()": _with(
        "torch.cuda.device({t}.device) if {t}.is_cuda else contextlib.nullcontext()"
    ),
    "a local bound to the guard": _guard_in_a_local,
    "with torch.cuda.device(t.device)": _with("torch.cuda.device({t}.device)"),
    "with torch.cuda.device_of(t)": _with("torch.cuda.device_of({t})"),
    "with torch.cuda.device(t.get_device())": _with("torch.cuda.device({t}.get_device())"),
    "with a project's device_guard(t.device)": _with("device_guard({t}.device)"),
    "torch.cuda.set_device(t.device) first": _set_device_first,
    "a caller holds the guard": _caller_holds_it,
}


def _guarded_again(source: str, guard: Callable[[ast.FunctionDef], list[ast.stmt]]) -> str:
    tree = ast.parse(source)
    entries = _entries(tree)
    assert entries, "the fixture has no public function to guard"
    body: list[ast.stmt] = []
    for stmt in tree.body:
        body += guard(stmt) if stmt in entries else [stmt]
    tree.body = body
    return ast.unparse(ast.fix_missing_locations(tree))


@pytest.mark.parametrize("guard", list(GUARDS), ids=list(GUARDS))
@pytest.mark.parametrize("form", [f for f, _ in FORMS])
def test_guarding_any_form_any_usual_way_silences_the_device_rules(form: str, guard: str, tmp_path: Path) -> None:
    source = (FORMS_DIR / f"{form}.py").read_text()
    assert lint_source(source, f"{form}.py", select=DEVICE_RULES), "the unguarded form must fire first"
    shutil.copy(FORMS_DIR / "kernels_lib.py", tmp_path / "kernels_lib.py")  # getattr_lookup's module
    rewritten = tmp_path / f"{form}.py"
    rewritten.write_text(_guarded_again(source, GUARDS[guard]))
    report = lint_paths([rewritten], select=DEVICE_RULES)
    assert report.errors == ()
    assert report.findings == (), [f.as_line() for f in report.findings]


# --- near-misses the forms must not catch, and the reads they must -----------------------------

HEADER = "import torch\nimport triton\nimport triton.language as tl\n\n"
_K = """
@triton.jit
def k(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, 1.0, mask=offs < n)
"""

CASES = [
    (
        "a dict of plain functions, indexed twice, is no launch",
        """
TABLE = {"a": {"b": print}}

def dispatch(kind, sub, x):
    TABLE[kind][sub](x)
""",
    ),
    (
        "getattr(...) called without a subscript is no launch",
        """
def dispatch(obj, name, x):
    getattr(obj, name)(x)
""",
    ),
    (
        "subprocess.run(..., grid=...) of no kernel is no launch",
        """
import subprocess

def go(cmd):
    subprocess.run(cmd, grid=(1,))
""",
    ),
    (
        "a local bound to a kernel only after its use does not make the use a launch",
        _K
        + """
def f(x, launchers):
    fn = launchers["plain"]
    fn[(1,)](x, 1, BLOCK=8)
    fn = k
""",
    ),
    (
        "a parameter subscripted and called is the caller's business",
        """
def f(kernel_fn, x):
    kernel_fn[(1,)](x)
""",
    ),
    (
        "a for loop over kernels launches each",
        _K
        + """
def f(x):
    for kern in (k, k):
        kern[(1,)](x, 1, BLOCK=8)  # FIRE: unguarded-launch
""",
    ),
    (
        "self.kernel bound to one of two kernels in __init__",
        _K
        + """
class Op:
    def __init__(self, fast):
        self.fn = k if fast else k

    def __call__(self, x):
        self.fn[(1,)](x, 1, BLOCK=8)  # FIRE: unguarded-launch
""",
    ),
    (
        "index fallback: x.device.index, else the current device, is the tensor's device",
        _K
        + """
def f(x):
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    with torch.cuda.device(x.device):
        k[(sms,)](x, 1, BLOCK=8)
""",
    ),
    (
        "a hard-coded device index is wrong under a guard too",
        _K
        + """
def f(x):
    with torch.cuda.device(x.device):
        sms = torch.cuda.get_device_properties(0).multi_processor_count  # FIRE: current-device-property
        k[(sms,)](x, 1, BLOCK=8)
""",
    ),
    (
        "Triton's driver properties of the current device sizing the grid; of x's device, silent",
        _K
        + """
from triton.runtime import driver

def f(x):
    props = driver.active.utils.get_device_properties(torch.cuda.current_device())  # FIRE: current-device-property
    with torch.cuda.device(x.device):
        k[(props["multiprocessor_count"],)](x, 1, BLOCK=8)

def g(x):
    props = driver.active.utils.get_device_properties(x.device.index)
    with torch.cuda.device(x.device):
        k[(props["multiprocessor_count"],)](x, 1, BLOCK=8)
""",
    ),
    (
        "a read of the current device that sizes nothing the kernel gets is silent",
        _K
        + """
def f(x):
    name = torch.cuda.get_device_properties("cuda").name
    print(name)
    with torch.cuda.device(x.device):
        k[(1,)](x, 1, BLOCK=8)
""",
    ),
    (
        "a read cached at import is cached-device-property's, reported once",
        _K
        + """
NUM_SMS = torch.cuda.get_device_properties("cuda").multi_processor_count  # FIRE: cached-device-property

def f(x):
    with torch.cuda.device(x.device):
        k[(NUM_SMS,)](x, 1, BLOCK=8)
""",
    ),
    (
        "a buffer on the current device passed to the launch is default-device-alloc's, not a read",
        _K
        + """
def f(x: torch.Tensor):
    y = torch.empty(8, device=torch.cuda.current_device())  # FIRE: default-device-alloc
    with torch.cuda.device(x.device):
        k[(1,)](y, 1, BLOCK=8)
""",
    ),
    (
        "the allocator's 'cuda' with every launch guarded, and one keyed by the tensor, are silent",
        """
@triton.jit
def tma(x_ptr, M, BLOCK: tl.constexpr):
    d = tl.make_tensor_descriptor(x_ptr, shape=[M], strides=[1], block_shape=[BLOCK])
    d.store([0], d.load([0]))

def f(x):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    with torch.cuda.device(x.device):
        tma[(1,)](x, 8, BLOCK=8)

def g(x):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device=x.device, dtype=torch.int8))
    with torch.cuda.device(x.device):
        tma[(1,)](x, 8, BLOCK=8)
""",
    ),
    (
        "an allocator on a hard-coded device is wrong whatever the launch",
        """
@triton.jit
def tma(x_ptr, M, BLOCK: tl.constexpr):
    d = tl.make_tensor_descriptor(x_ptr, shape=[M], strides=[1], block_shape=[BLOCK])
    d.store([0], d.load([0]))

def _alloc(size, align, stream):
    return torch.empty(size, device="cuda:0", dtype=torch.int8)  # FIRE: default-device-alloc

def f(x):
    triton.set_allocator(_alloc)
    with torch.cuda.device(x.device):
        tma[(1,)](x, 8, BLOCK=8)
""",
    ),
    (
        "the allocator's 'cuda' while only kernels without descriptors launch unguarded: silent",
        _K
        + """
def f(x):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    k[(1,)](x, 1, BLOCK=8)  # FIRE: unguarded-launch
""",
    ),
]


def _marked(source: str) -> set[tuple[int, str]]:
    out = set()
    for i, line in enumerate(source.splitlines(), 1):
        hit = re.search(r"# FIRE: ([a-z-]+)$", line.rstrip())
        if hit:
            out.add((i, hit.group(1)))
    return out


@pytest.mark.parametrize(("edge", "body"), CASES, ids=[c[0] for c in CASES])
def test_near_misses_and_reads(edge: str, body: str) -> None:
    source = HEADER + textwrap.dedent(body)
    found = lint_source(source, "case.py")
    assert _found(found) == _marked(source), [f.as_line() for f in found]


def test_the_message_names_every_kernel_a_picked_launch_may_run() -> None:
    (finding,) = lint_paths([FORMS_DIR / "conditional_local.py"]).findings
    assert "`fn` (one of `_copy_kernel_ws`, `_copy_kernel`)" in finding.message
    assert finding.fix.startswith("with torch.cuda.device(x.device):")


def test_the_read_names_the_launch_it_sizes_and_its_cause() -> None:
    report = lint_paths([FORMS_DIR / "sm_count_grid.py"], select=[Rule.CURRENT_DEVICE_PROPERTY])
    (finding,) = report.findings
    assert finding.cause == "per-device-state-cached"
    assert "sizes the grid of the launch of `_persistent_sum_kernel`" in finding.message
    assert "x.device" in finding.fix
