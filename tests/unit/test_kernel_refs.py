"""One ``--kernel`` grammar (``qmoe_doctor.core.kernel_ref.KernelRef``): every form parsed, checked
in the parent, resolved in the child, rendered into scripts, and every command agreeing.

The table below runs through ``scan``, ``check``, ``repro`` and ``parallel`` (CliRunner, CPU): a
reference each accepts reaches its workflow as the same canonical text (the workflow is replaced
by a stub: no probe runs); a reference each refuses exits 2 with the same one line. One row per
form then runs for real, through the probe child's loader under the Triton interpreter.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from qmoe_doctor.cli import devices, parallel_runs
from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.commands import check as check_cmd
from qmoe_doctor.cli.commands import repro as repro_cmd
from qmoe_doctor.cli.commands import scan as scan_cmd
from qmoe_doctor.core.kernel_ref import KernelRef, KernelRefError, RefKind
from qmoe_doctor.machine.inventory import GpuInfo, Inventory
from qmoe_doctor.reports.repro_script import script_kernel_ref

runner = CliRunner()
MOD = "qd_kernel_refs_mod"  # written into the test's folder, on PYTHONPATH (the child inherits it)
REACHED = 99  # the stub workflows' exit: the reference was accepted and handed on

MODULE_SOURCE = f'''
from qmoe_doctor.kernels import moe_grouped_gemm
from qmoe_doctor.probes.adapters import SimpleAdapter


def fn(x, w, m_sizes):
    return moe_grouped_gemm(x, w, m_sizes)


def fn_flat(x, w2d, m_sizes):  # the flat-weight convention: w2d (E*N, K)
    return moe_grouped_gemm(x, w2d.view(m_sizes.shape[0], -1, x.shape[1]), m_sizes)


def fn_routed(hidden_states, w, topk_ids, topk_weights):  # the routed protocol
    from qmoe_doctor.kernels.routed import routed_moe

    return routed_moe(hidden_states, w, topk_ids, topk_weights)


def _wrap(target):
    return lambda x, w, m_sizes: target(x, w, m_sizes)


ADAPTER = SimpleAdapter(wrap=_wrap, default_target="{MOD}:fn")
'''


@pytest.fixture
def where(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder with the user's kernel module (also loaded as a file), on PYTHONPATH, and a
    sub-folder (a directory where a file is meant)."""
    (tmp_path / f"{MOD}.py").write_text(textwrap.dedent(MODULE_SOURCE))
    (tmp_path / "a_folder.py").mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.chdir(tmp_path)  # the child resolves relative paths from the same folder
    return tmp_path


# (reference, accepted, what the row covers). "{file}" is the module's file, relative to the
# working directory; "{dir}" is a folder named like a .py file.
REFS: list[tuple[str, bool, str]] = [
    ("builtin", True, "our kernel"),
    ("torch:grouped_mm", True, "the torch control"),
    ("specimen:unmasked_rows", True, "a specimen"),
    (f"{MOD}:fn", True, "module:function, found through PYTHONPATH without importing it"),
    ("./{file}:fn", True, "path/to/file.py:function"),
    (f"adapter:{MOD}.ADAPTER", True, "a dotted adapter with its default target"),
    (f"adapter:{MOD}.ADAPTER:./{{file}}:fn", True, "an adapter applied to a file target"),
    (f"adapter:{MOD}.ADAPTER:{MOD}:fn", True, "an adapter applied to a module target"),
    (f"adapter:{MOD}.ADAPTER:specimen:unmasked_rows", True, "an adapter applied to a specimen"),
    (f"adapter:{MOD}.ADAPTER:builtin", True, "an adapter applied to our kernel"),
    ("adapter:flat-weights:./{file}:fn_flat", True, "the built-in flat-weight adapter on a file target"),
    (f"adapter:flat-weights:{MOD}:fn_flat", True, "the built-in flat-weight adapter on a module target"),
    ("adapter:routed", True, "the built-in routed adapter alone: our routed kernel"),
    ("adapter:routed-rows:./{file}:fn_routed", True, "the built-in routed-rows adapter on a file target"),
    ("specimen:sorted_ids", True, "a routed specimen"),
    ("", False, "empty"),
    (":", False, "a colon alone"),
    ("a:b:c:d", False, "colons that name no module"),
    ("no_colon_here", False, "no function"),
    ("specimen:unmasked_rowz", False, "a misspelt specimen"),
    ("specimen:[/]", False, "rich markup in a specimen name"),
    ("missing/kernel.py:fn", False, "a missing file"),
    ("./{dir}:fn", False, "a folder where a file is meant"),
    ("[/]/k.py:fn", False, "rich markup in a file path"),
    ("qd_no_such_pkg_xyz.ops:fn", False, "a module that is not installed"),
    (f"{MOD}:not-a-name", False, "a function name that is not an identifier"),
    ("adapter:", False, "an adapter without a name"),
    ("adapter:misspelt_adapter", False, "a misspelt adapter: no entry point of that name"),
    ("adapter:flat-weights", False, "a built-in adapter without the kernel it adapts"),
    ("adapter:flat-weights:missing/k.py:fn", False, "a built-in adapter with a missing file target"),
    ("adapter:routed:missing/k.py:fn", False, "the routed adapter with a missing file target"),
    ("adapter:qd_no_such_pkg_xyz.ADAPTER", False, "a dotted adapter whose module is not there"),
    (f"adapter:{MOD}.ADAPTER:missing/k.py:fn", False, "an adapter with a missing file target"),
    (f"adapter:{MOD}.ADAPTER:", False, "an adapter with an empty target"),
    (f"adapter:{MOD}.ADAPTER:adapter:x", False, "an adapter of an adapter"),
]


def _text(template: str) -> str:
    return template.replace("{file}", f"{MOD}.py").replace("{dir}", "a_folder.py")


def _stub_workflows(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace every command's workflow by a stub that records the kernel it got and exits 99."""
    seen: list[str] = []

    def reached(kernel: str) -> Any:
        seen.append(kernel)
        raise typer.Exit(REACHED)

    gpus = tuple(GpuInfo(index=i, name="NVIDIA H200", uuid=f"GPU-{i}", pci_bus_id=f"0:{i}") for i in range(2))
    monkeypatch.setattr(devices, "collect_inventory", lambda: Inventory(gpus=gpus))
    monkeypatch.setattr(scan_cmd, "run_scan", lambda plan, **kw: reached(plan.kernel))
    monkeypatch.setattr(check_cmd, "run_check", lambda kernels, **kw: reached(kernels[0]))
    monkeypatch.setattr(repro_cmd, "run_repro", lambda plan, *a, **kw: reached(plan.kernel))
    monkeypatch.setattr(parallel_runs, "run_parallel", lambda plan, **kw: reached(plan.kernel))
    return seen


COMMANDS: dict[str, Callable[[str, Path], list[str]]] = {
    "scan": lambda ref, tmp: ["scan", "--kernel", ref, "--log-dir", str(tmp / "l")],
    "check": lambda ref, tmp: ["check", "--kernel", ref, "--log-dir", str(tmp / "l")],
    "repro": lambda ref, tmp: ["repro", "--kernel", ref, "--out", str(tmp), "--log-dir", str(tmp / "l")],
    "parallel": lambda ref, tmp: [
        "parallel",
        "--cpu",
        "--modes",
        "dp",
        "--kernel",
        ref,
        "--log-dir",
        str(tmp / "l"),
    ],
}


def _error_line(output: str) -> str:
    lines = [ln for ln in output.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, output
    return lines[0]


@pytest.mark.parametrize(("template", "accepted", "edge"), REFS, ids=[r[2] for r in REFS])
def test_every_command_agrees(
    template: str, accepted: bool, edge: str, where: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = _text(template)
    seen = _stub_workflows(monkeypatch)
    results = {name: runner.invoke(app, args(text, where)) for name, args in COMMANDS.items()}
    for name, result in results.items():
        assert "Traceback" not in result.output, (name, result.output)
        assert result.exception is None or isinstance(result.exception, SystemExit), (name, result.output)
    if accepted:
        canonical = str(KernelRef.parse(text).validate())
        assert {n: r.exit_code for n, r in results.items()} == dict.fromkeys(COMMANDS, REACHED), {
            n: r.output for n, r in results.items()
        }
        assert seen == [canonical] * len(COMMANDS), edge
        return
    with pytest.raises(KernelRefError) as refused:
        KernelRef.parse(text).validate()
    assert {n: r.exit_code for n, r in results.items()} == dict.fromkeys(COMMANDS, 2), {
        n: r.output for n, r in results.items()
    }
    lines = {name: _error_line(result.stderr) for name, result in results.items()}
    assert set(lines.values()) == {f"error: {refused.value}"}, lines
    assert not seen  # nothing was handed to a workflow


# --- one row per form through the probe child's loader (Triton interpreter) --------------------

REAL = [
    ("builtin", "builtin"),
    ("torch:grouped_mm", "the control: on the CPU it may fail, but it resolves"),
    ("specimen:unmasked_rows", "specimen"),
    (f"{MOD}:fn", "module"),
    ("./{file}:fn", "file"),
    (f"adapter:{MOD}.ADAPTER", "adapter, default target"),
    (f"adapter:{MOD}.ADAPTER:./{{file}}:fn", "adapter, file target"),
    ("adapter:flat-weights:./{file}:fn_flat", "built-in adapter, file target"),
    ("adapter:routed:./{file}:fn_routed", "built-in routed adapter, file target"),
    ("specimen:gather_scatter", "routed specimen"),
]


@pytest.mark.parametrize(("template", "form"), REAL, ids=[r[1] for r in REAL])
def test_each_form_resolves_in_the_probe_child(template: str, form: str, where: Path) -> None:
    result = runner.invoke(
        app,
        [
            "scan",
            "--cpu",
            "--only",
            "single",
            "--json",
            "--kernel",
            _text(template),
            "--log-dir",
            str(where / "l"),
        ],
    )
    assert result.exit_code != 2, result.output
    doc = json.loads(result.stdout)
    (single,) = [o for o in doc["outcomes"] if o["spec"]["condition"] == "single"]
    assert single["error_kind"] != "kernel-import", single
    assert single["spec"]["kernel"] == str(KernelRef.parse(_text(template)))


def test_a_kernel_the_child_cannot_import_is_a_usage_error(where: Path) -> None:
    (where / "broken.py").write_text("import qd_not_a_real_module\n\ndef fn(x, w, m_sizes):\n    return x\n")
    result = runner.invoke(app, ["scan", "--cpu", "--only", "single", "--kernel", "broken.py:fn"])
    assert result.exit_code == 2, result.output
    assert "could not be used" in result.stderr and "qd_not_a_real_module" in result.stderr
    assert "fn(x, w, m_sizes) -> y" in result.stderr and "Traceback" not in result.output


# --- the record: parse, canonical text, sources, scripts ----------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "name", "attr"),
    [
        ("builtin", RefKind.BUILTIN, "", ""),
        ("torch:grouped_mm", RefKind.TORCH, "", ""),
        ("specimen:unguarded", RefKind.SPECIMEN, "unguarded", ""),
        ("pkg.ops.moe:grouped_mm", RefKind.MODULE, "pkg.ops.moe", "grouped_mm"),
        ("path/to/k.py:fn", RefKind.FILE, "path/to/k.py", "fn"),
        ("k.py:fn", RefKind.FILE, "k.py", "fn"),
        ("C:/Users/me/k.py:fn", RefKind.FILE, "C:/Users/me/k.py", "fn"),  # the last colon splits
        ("adapter:lib", RefKind.ADAPTER, "lib", ""),
        ("adapter:my.lib.ADAPTER:path/k.py:fn", RefKind.ADAPTER, "my.lib.ADAPTER", ""),
    ],
)
def test_parse_and_canonical_text(text: str, kind: RefKind, name: str, attr: str) -> None:
    ref = KernelRef.parse(text)
    assert (ref.kind, ref.name, ref.attr) == (kind, name, attr)
    assert str(ref) == text and KernelRef.parse(str(ref)) == ref


def test_adapter_target_is_a_ref_of_its_own() -> None:
    ref = KernelRef.parse("adapter:lib:path/k.py:fn")
    assert ref.target == KernelRef(kind=RefKind.FILE, name="path/k.py", attr="fn")
    assert KernelRef.parse(" builtin ") == KernelRef.parse("builtin")


def test_source_path_never_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "qd_src_pkg"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (pkg / "ops" / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (pkg / "ops" / "moe.py").write_text("def fn(x, w, m_sizes):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert KernelRef.parse("qd_src_pkg.ops.moe:fn").source_path() == pkg / "ops" / "moe.py"
    assert KernelRef.parse("qd_src_pkg.ops:fn").source_path() == pkg / "ops" / "__init__.py"
    assert KernelRef.parse(f"adapter:lib:{pkg / 'ops' / 'moe.py'}:fn").source_path() == pkg / "ops" / "moe.py"
    assert KernelRef.parse("qd_src_pkg.nothing:fn").source_path() is None
    builtin = KernelRef.parse("builtin").source_path()
    assert builtin is not None and builtin.name == "grouped_gemm.py" and builtin.is_file()
    for name in ("unguarded", "unmasked_rows"):
        source = KernelRef.parse(f"specimen:{name}").source_path()
        assert source is not None and source.name == f"{name}.py" and "# PLANTED:" in source.read_text()
    for text in ("torch:grouped_mm", "adapter:lib", "specimen:nope"):
        assert KernelRef.parse(text).source_path() is None, text


def test_scripts_render_from_the_same_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert script_kernel_ref("builtin") == ("qmoe_doctor.kernels.grouped_gemm:moe_grouped_gemm", False)
    assert script_kernel_ref("torch:grouped_mm") == ("qmoe_doctor.probes.loader:torch_grouped_mm", False)
    assert script_kernel_ref("specimen:unguarded") == (
        "qmoe_doctor.kernels.specimens.unguarded:moe_grouped_gemm",
        False,
    )
    assert script_kernel_ref("pkg.mod:fn") == ("pkg.mod:fn", False)
    assert script_kernel_ref("rel/k.py:fn") == (f"{tmp_path / 'rel' / 'k.py'}:fn", False)
    # an adapter needs qmoe-doctor's loader; its file target is made absolute all the same
    assert script_kernel_ref("adapter:lib:rel/k.py:fn") == (
        f"adapter:lib:{tmp_path / 'rel' / 'k.py'}:fn",
        True,
    )


def test_the_child_loader_parses_with_the_same_grammar() -> None:
    from qmoe_doctor.probes.loader import KernelResolutionError, load_kernel

    with pytest.raises(KernelResolutionError, match="expected module:function"):
        load_kernel("no_colon_here")
    with pytest.raises(KernelResolutionError, match="unknown specimen 'nope'"):
        load_kernel("specimen:nope")
    with pytest.raises(KernelResolutionError, match="kernel file 'missing/k.py' does not exist"):
        load_kernel("missing/k.py:fn")
