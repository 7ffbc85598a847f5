"""Kernel adapters: the --kernel adapter:NAME[:TARGET] syntax (parent), resolution through entry
points and dotted paths (child side, tested in-process), broken adapters, declared limits that
turn probes into skips with reasons, and one end-to-end check on the CPU tier."""

from __future__ import annotations

import importlib.metadata
import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.kernel_ref import (
    BUILTIN_ADAPTERS,
    ENTRY_POINT_GROUP,
    KernelRef,
    KernelRefError,
    RefKind,
    installed_adapters,
)
from qmoe_doctor.core.records import Condition, ProbeSpec, Shape
from qmoe_doctor.probes import adapters as child
from qmoe_doctor.probes.loader import KernelResolutionError

runner = CliRunner()

# A kernel with another signature (w transposed, cumulative offsets) and adapters for it. The
# kernel is plain Python so the in-process tests need no torch.
ADAPTER_MODULE = '''
from qmoe_doctor.probes.adapters import SimpleAdapter


def offs_mm(x, w_t, offs):
    return ("offs_mm", x, w_t, offs)


def _wrap(grouped_mm):
    def fn(x, w, m_sizes):
        return grouped_mm(x, ("T", w), ("cumsum", m_sizes))
    return fn


ANY = SimpleAdapter(wrap=_wrap, default_target="{mod}:offs_mm")
BF16 = SimpleAdapter(wrap=_wrap, dtypes=frozenset({{"bfloat16"}}), supports_cpu=False)
CONTIG = SimpleAdapter(wrap=_wrap, needs_contiguous=True)


class ClassAdapter:
    dtypes = None
    needs_contiguous = False
    supports_cpu = True
    default_target = "{mod}:offs_mm"

    def adapt(self, target):
        return _wrap(target)


NOT_AN_ADAPTER = 42
WRONG_SIGNATURE = SimpleAdapter(wrap=lambda fn: (lambda x: fn))
RAISES = SimpleAdapter(wrap=lambda fn: 1 / 0)
'''


def _write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    return name


@pytest.fixture
def mod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    name = "qd_adapters_" + re.sub(r"\W", "_", request.node.name)
    return _write_module(tmp_path, monkeypatch, name, ADAPTER_MODULE.format(mod=name))


class _EntryPoints:
    """What importlib.metadata.entry_points(group=...) returns, for a fake distribution."""

    def __init__(self, eps: list[importlib.metadata.EntryPoint]) -> None:
        self.eps = eps

    def __call__(self, **kwargs: Any) -> list[importlib.metadata.EntryPoint]:
        return [ep for ep in self.eps if ep.group == kwargs.get("group")]


def _fake_distribution(monkeypatch: pytest.MonkeyPatch, **entries: str) -> None:
    eps = [importlib.metadata.EntryPoint(name=n, value=v, group=ENTRY_POINT_GROUP) for n, v in entries.items()]
    monkeypatch.setattr(importlib.metadata, "entry_points", _EntryPoints(eps))


# --- parent side: syntax and validation (nothing imported) --------------------------------------


def _adapter(name: str, target: str | None = None) -> KernelRef:
    return KernelRef(kind=RefKind.ADAPTER, name=name, target=KernelRef.parse(target) if target else None)


@pytest.mark.parametrize(
    ("ref", "parsed"),
    [
        ("adapter:mylib", _adapter("mylib")),
        ("adapter:mylib:builtin", _adapter("mylib", "builtin")),
        ("adapter:mylib:specimen:unguarded", _adapter("mylib", "specimen:unguarded")),
        ("adapter:mylib:pkg.ops:grouped_mm", _adapter("mylib", "pkg.ops:grouped_mm")),
        ("adapter:my.adapters.X:path/to/k.py:fn", _adapter("my.adapters.X", "path/to/k.py:fn")),
    ],
)
def test_parse_adapter_ref(ref: str, parsed: KernelRef) -> None:
    assert KernelRef.parse(ref) == parsed
    assert str(parsed) == ref


@pytest.mark.parametrize("ref", ["adapter:", "adapter::x:y", "adapter:lib:justaname", "adapter:lib:mod:", "adapter:a b"])
def test_malformed_adapter_refs(ref: str) -> None:
    with pytest.raises(KernelRefError, match="adapter"):
        KernelRef.parse(ref)


def test_entry_point_group_is_the_public_name() -> None:
    """Kernel libraries register under this name in their pyproject.toml: it never follows a
    module's path inside the package."""
    assert ENTRY_POINT_GROUP == "qmoe_doctor.adapters"


def test_validate_knows_installed_adapters_from_metadata_only(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_distribution(monkeypatch, fakelib="module_that_does_not_exist:ADAPTER")
    assert installed_adapters() == {"fakelib": "module_that_does_not_exist:ADAPTER"}
    assert KernelRef.parse("adapter:fakelib").validate().name == "fakelib"  # not imported: no error
    with pytest.raises(KernelRefError, match="no adapter named 'other'.*fakelib"):
        KernelRef.parse("adapter:other:json:dumps").validate()
    assert KernelRef.parse("adapter:json.ADAPTER:json:dumps").validate()  # a dotted path: findable
    with pytest.raises(KernelRefError, match="cannot find the adapter module 'nosuchpkg_qd'"):
        KernelRef.parse("adapter:nosuchpkg_qd.ADAPTER:json:dumps").validate()
    with pytest.raises(KernelRefError, match="does not exist"):
        KernelRef.parse("adapter:fakelib:missing/kernel.py:fn").validate()
    with pytest.raises(KernelRefError, match="unknown specimen"):
        KernelRef.parse("adapter:fakelib:specimen:nope").validate()


# --- child side: resolution -------------------------------------------------------------------


def test_dotted_adapter_wraps_the_target(mod: str) -> None:
    kernel = child.load_adapted(f"adapter:{mod}.ANY:{mod}:offs_mm")
    assert isinstance(kernel, child.AdaptedKernel)
    assert kernel("x", "w", "m") == ("offs_mm", "x", ("T", "w"), ("cumsum", "m"))
    assert kernel.limits == child.KernelLimits()


def test_default_target_and_adapter_classes(mod: str) -> None:
    assert child.load_adapted(f"adapter:{mod}.ANY")("x", "w", "m")[0] == "offs_mm"
    assert child.load_adapted(f"adapter:{mod}.ClassAdapter")("x", "w", "m")[0] == "offs_mm"


def test_entry_point_adapter_of_a_fake_distribution(mod: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_distribution(monkeypatch, fakelib=f"{mod}:BF16")
    kernel = child.load_adapted(f"adapter:fakelib:{mod}:offs_mm")
    assert kernel.limits == child.KernelLimits(dtypes=frozenset({"bfloat16"}), supports_cpu=False)
    assert kernel("x", "w", "m")[0] == "offs_mm"


def test_the_loader_routes_adapter_refs(mod: str) -> None:
    from qmoe_doctor.probes.loader import load_kernel

    kernel = load_kernel(f"adapter:{mod}.CONTIG:{mod}:offs_mm")
    assert isinstance(kernel, child.AdaptedKernel) and kernel.limits.needs_contiguous


@pytest.mark.parametrize(
    ("suffix", "needle"),
    [
        (".NOT_AN_ADAPTER:{mod}:offs_mm", "not a KernelAdapter"),
        (".MISSING:{mod}:offs_mm", "has no attribute 'MISSING'"),
        (".WRONG_SIGNATURE:{mod}:offs_mm", "fn\\(x, w, m_sizes\\)"),
        (".RAISES:{mod}:offs_mm", "could not adapt.*ZeroDivisionError"),
        (".BF16", "has no default_target"),
        (".ANY:{mod}:nothing_here", "has no attribute 'nothing_here'"),
    ],
)
def test_broken_adapters_are_resolution_errors(mod: str, suffix: str, needle: str) -> None:
    with pytest.raises(KernelResolutionError, match=needle):
        child.load_adapted(f"adapter:{mod}" + suffix.format(mod=mod))


def test_adapter_module_that_fails_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = _write_module(tmp_path, monkeypatch, "qd_broken_adapter", "import torch_that_is_not_installed\n")
    with pytest.raises(KernelResolutionError, match="cannot import module 'qd_broken_adapter'.*ModuleNotFoundError"):
        child.load_adapted(f"adapter:{name}.ADAPTER:x:y")
    _fake_distribution(monkeypatch, brokenlib=f"{name}:ADAPTER")
    with pytest.raises(KernelResolutionError, match="adapter 'brokenlib' .* could not be loaded"):
        child.load_adapted("adapter:brokenlib:x:y")
    with pytest.raises(KernelResolutionError, match="no adapter named 'absent'.*brokenlib"):
        child.load_adapted("adapter:absent:x:y")


def test_resolution_errors_are_classified_as_kernel_import() -> None:
    from qmoe_doctor.core.error_kind import classify_error
    from qmoe_doctor.core.records import ErrorKind

    assert classify_error("qmoe_doctor.probes.loader.KernelResolutionError", "no adapter") is ErrorKind.KERNEL_IMPORT


# --- declared limits: probes that do not apply are skipped with the reason ----------------------


def _spec(condition: Condition, *, device: int | None, dtype: str, variant: str | None = None) -> ProbeSpec:
    return ProbeSpec(
        probe_id=f"x/{condition}",
        kernel="adapter:x",
        condition=condition,
        device=device,
        current=device,
        shape=Shape(m=64, e=4, n=32, k=32, dtype=dtype),  # type: ignore[arg-type]
        params={"variant": variant} if variant else {},
    )


@pytest.mark.parametrize(
    ("limits", "spec", "reason"),
    [
        (child.KernelLimits(dtypes=frozenset({"bfloat16"})), _spec(Condition.SINGLE, device=0, dtype="float32"),
         "takes bfloat16 only; this probe runs float32"),
        (child.KernelLimits(dtypes=frozenset({"bfloat16"})), _spec(Condition.SINGLE, device=0, dtype="bfloat16"), None),
        (child.KernelLimits(supports_cpu=False), _spec(Condition.SINGLE, device=None, dtype="float32"),
         "declares no CPU support"),
        (child.KernelLimits(needs_contiguous=True),
         _spec(Condition.OFFSETS, device=None, dtype="float32", variant="transposed-w"), "requires contiguous"),
        (child.KernelLimits(needs_contiguous=True),
         _spec(Condition.OFFSETS, device=None, dtype="float32", variant="storage-offset-8"), None),
        (child.KernelLimits(needs_contiguous=True), _spec(Condition.SINGLE, device=None, dtype="float32"), None),
    ],
)
def test_not_applicable(limits: child.KernelLimits, spec: ProbeSpec, reason: str | None) -> None:
    kernel = child.AdaptedKernel(lambda x, w, m: None, ref="adapter:x", limits=limits)
    got = child.not_applicable(kernel, spec)
    assert (got is None) if reason is None else (got is not None and reason in got), got


def test_plain_kernels_declare_no_limits() -> None:
    assert child.not_applicable(lambda x, w, m: None, _spec(Condition.SINGLE, device=None, dtype="float32")) is None


def test_torch_dtype_names_are_accepted() -> None:
    class A:
        dtypes = ("torch.bfloat16", "float16")

        def adapt(self, target: object) -> object:
            return target

    assert child.limits_of(A()).dtypes == frozenset({"bfloat16", "float16"})


# --- end to end: the CPU tier in real children -------------------------------------------------


E2E_MODULE = """
from qmoe_doctor.kernels import moe_grouped_gemm
from qmoe_doctor.probes.adapters import SimpleAdapter

def offs_mm(x, w_t, offs):  # another signature: w as (E, K, N), cumulative offsets
    sizes = offs.diff(prepend=offs.new_zeros(1)).to(offs.dtype)
    return moe_grouped_gemm(x, w_t.transpose(1, 2), sizes)

def _wrap(fn):
    return lambda x, w, m_sizes: fn(x, w.transpose(1, 2), m_sizes.cumsum(0, dtype=m_sizes.dtype))

CONTIG = SimpleAdapter(wrap=_wrap, needs_contiguous=True, default_target="qd_e2e_adapters:offs_mm")
BF16 = SimpleAdapter(wrap=_wrap, dtypes=frozenset({"bfloat16"}), supports_cpu=False)
"""


def _check_e2e(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, dict[str, Any]]:
    """`check --cpu` in real probe children, which import the adapter module from PYTHONPATH."""
    (tmp_path / "qd_e2e_adapters.py").write_text(E2E_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out = tmp_path / "check.json"
    result = runner.invoke(
        app, ["check", "--cpu", *args, "--save", str(out), "--log-dir", str(tmp_path / "logs")]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, json.loads(out.read_text())


def test_contiguous_only_kernel_skips_the_strided_variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, doc = _check_e2e(tmp_path, monkeypatch, "--only", "offsets", "-k", "adapter:qd_e2e_adapters.CONTIG")
    assert code == 0, doc
    (kernel,) = doc["kernels"]
    skipped = {c["name"]: c["detail"] for c in kernel["cells"] if c["verdict"] == "skip"}
    assert set(skipped) == {"offsets:padded-rows", "offsets:transposed-w"}
    assert all("requires contiguous inputs" in d for d in skipped.values())
    passed = {c["name"] for c in kernel["cells"] if c["verdict"] == "pass"}
    assert {"offsets:storage-offset-8", "offsets:hot-expert"} <= passed


def test_a_check_where_every_probe_was_skipped_is_not_a_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16-only, GPU-only kernel on the CPU tier: every probe is skipped with the
    adapter's reason, and a check that ran nothing exits 4 (it asserted nothing)."""
    code, doc = _check_e2e(
        tmp_path, monkeypatch, "--only", "single,negative-sizes",
        "-k", "adapter:qd_e2e_adapters.BF16:qd_e2e_adapters:offs_mm",
    )
    assert code == 4
    (kernel,) = doc["kernels"]
    assert kernel["exit_code"] == 4 and "no probe ran" in kernel["problem"]
    env_check, *cells = kernel["cells"]
    assert env_check["name"] == "interpreter-check" and env_check["verdict"] == "pass"
    assert [c["verdict"] for c in cells] == ["skip", "skip"]
    assert all("no CPU support" in c["detail"] for c in cells)


# --- the built-in adapters: adapter:flat-weights:TARGET ---------------------------------------

FLAT_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "kernels" / "flat_weights.py"
FLAT_REF = f"adapter:flat-weights:{FLAT_FIXTURE}:grouped_gemm"


def test_builtin_adapters_need_no_entry_point_and_take_a_target(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_distribution(monkeypatch)  # no distribution registers any adapter
    assert installed_adapters() == {}
    assert set(BUILTIN_ADAPTERS) == {"flat-weights", "routed", "routed-rows"}
    assert KernelRef.parse(FLAT_REF).validate().target == KernelRef.parse(f"{FLAT_FIXTURE}:grouped_gemm")
    assert KernelRef.parse("adapter:flat-weights:json:dumps").validate()
    with pytest.raises(KernelRefError, match="adapts your kernel: name it, adapter:flat-weights:module:function"):
        KernelRef.parse("adapter:flat-weights").validate()
    with pytest.raises(KernelRefError, match="does not exist"):
        KernelRef.parse("adapter:flat-weights:missing/kernel.py:fn").validate()
    # the routed adapters alone mean our routed kernels; with a target, the user's
    assert KernelRef.parse("adapter:routed").validate().default_target() == KernelRef.parse(
        "qmoe_doctor.kernels.routed:routed_moe"
    )
    assert KernelRef.parse("adapter:routed-rows:json:dumps").validate().protocol == "routed-rows"
    with pytest.raises(KernelRefError, match=r"not one of ours \(flat-weights, routed, routed-rows\)"):
        KernelRef.parse("adapter:flat-weight:json:dumps").validate()


def test_builtin_adapter_names_are_reserved(monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution registering an adapter under a built-in name is never consulted."""
    _fake_distribution(monkeypatch, **{"flat-weights": "json:dumps"})
    assert child.find_adapter("flat-weights") is child.FLAT_WEIGHTS


@pytest.mark.parametrize("name", sorted(BUILTIN_ADAPTERS))
def test_every_builtin_adapter_resolves_on_the_child_side(name: str) -> None:
    adapter = child.find_adapter(name)
    assert isinstance(adapter, child.KernelAdapter)
    # flat-weights: the kernel is the user's (adapter:NAME:TARGET); routed: ours unless named
    assert adapter.default_target == BUILTIN_ADAPTERS[name].default_target
    assert child.limits_of(adapter) == child.KernelLimits()  # any dtype, layout, CPU tensors


def test_flatten_experts_hands_the_kernel_the_probes_layouts() -> None:
    """Where w (E, N, K) has an (E*N, K) view, the kernel gets it (same storage, same offset and
    row pitch: the offset and padded-row cells test the kernel); a transposed w is copied into
    a column-major (E*N, K), so the transposed-w cell still hands it a strided w."""
    import torch

    e, n, k = 3, 4, 8
    base = torch.randn(e, n, k)
    buf = torch.zeros(e * n * k + 1)
    offset = buf[1:].view(e, n, k).copy_(base)  # storage-offset-1
    padded = torch.zeros(e, n, k + 5)[:, :, :k].copy_(base)  # rows padded in K
    transposed = base.transpose(1, 2).contiguous().transpose(1, 2)
    sliced = torch.zeros(e, n + 2, k)[:, :n, :].copy_(base)  # experts padded in N: no (E*N, K) view
    for w, same_storage, strides in (
        (base, True, (k, 1)),
        (offset, True, (k, 1)),
        (padded, True, (k + 5, 1)),
        (transposed, False, (1, e * n)),
        (sliced, False, (k, 1)),
    ):
        w2d = child.flatten_experts(w)
        assert torch.equal(w2d, base.reshape(e * n, k))
        assert (w2d.data_ptr() == w.data_ptr()) is same_storage and w2d.stride() == strides, w.stride()


def test_flat_weights_adapter_calls_the_kernel_with_flattened_weights() -> None:
    import torch

    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch

    kernel = child.load_adapted(FLAT_REF)
    assert isinstance(kernel, child.AdaptedKernel) and kernel.limits == child.KernelLimits()
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, 32, generator=gen), torch.randn(3, 36, 32, generator=gen)
    m_sizes = torch.tensor([10, 0, 30], dtype=torch.int32)
    ref = moe_grouped_gemm_torch(x, w, m_sizes)
    for weights in (w, w.transpose(1, 2).contiguous().transpose(1, 2)):
        y = kernel(x, weights, m_sizes)
        assert float((y - ref).norm() / ref.norm()) < 1e-5
    raw = child.resolve_object(KernelRef.parse(f"{FLAT_FIXTURE}:grouped_gemm"))
    with pytest.raises(ValueError, match="w2d must be 2-D"):  # what the adapter spares the user
        raw(x, w, m_sizes)


def test_flat_weight_kernel_through_scan_and_check_on_the_cpu_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every cell runs (none skipped for the adapter's sake) and passes; check lints the
    kernel's own file, not the adapter."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    scan = runner.invoke(app, ["scan", "--cpu", "--json", "-k", FLAT_REF, "--log-dir", str(tmp_path / "scan")])
    assert scan.exit_code == 0, scan.output
    report = json.loads(scan.stdout)
    assert report["healthy"] is True and report["diagnoses"] == [] and report["unexplained"] == []
    cells = {o["probe_id"].split("/", 1)[1]: o for o in report["outcomes"] if o["spec"]["condition"] != "launch-config"}
    assert {"over-routed", "negative-sizes", "offsets:storage-offset-1", "offsets:transposed-w"} <= set(cells)
    assert all(c["status"] == "pass" for c in cells.values()), {n: c["status"] for n, c in cells.items()}
    out = tmp_path / "check.json"
    check = runner.invoke(
        app, ["check", "--cpu", "--only", "single", "-k", FLAT_REF, "--save", str(out), "--log-dir", str(tmp_path / "c")]
    )
    assert check.exit_code == 0, check.output
    (kernel,) = json.loads(out.read_text())["kernels"]
    assert [Path(f).name for f in kernel["lint"]["files"]] == ["flat_weights.py"]


def test_specimens_command_lists_the_builtin_adapters() -> None:
    doc = json.loads(runner.invoke(app, ["specimens", "--json"]).stdout)
    assert [a["name"] for a in doc["adapters"]] == list(BUILTIN_ADAPTERS)
    flat, routed, rows = doc["adapters"]
    assert flat["kernel"] == "adapter:flat-weights:TARGET" and "(E*N, K)" in flat["takes"]
    assert routed["kernel"] == "adapter:routed[:TARGET]" and routed["protocol"] == "routed"
    assert rows["default_target"] == "qmoe_doctor.kernels.routed:routed_moe_rows" and "(T*k, N)" in rows["takes"]
    text = runner.invoke(app, ["specimens"], env={"COLUMNS": "200"}).output
    assert "adapter:flat-weights:TARGET" in text
