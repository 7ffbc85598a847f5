"""The lean launch path (``kernels/launch.py`` and the launch plans of ``grouped_gemm`` and
``backward``): a call's shape-derived work is done once per plan key; a steady-state call reads
no tensor on the host (m_sizes above all: a read would synchronize with the GPU); the compiled
kernel's launcher gets the same arguments, in the kernel's parameter order, that
``kernel[grid](...)`` would; anything that watches launches turns the lean path off.

The interpreter runs the kernels here; the compiled-launcher half uses a stand-in kernel (no GPU)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels import backward as bw
from qmoe_doctor.kernels import grouped_gemm as gg
from qmoe_doctor.kernels import launch as L
from qmoe_doctor.kernels.backward import (
    moe_grouped_gemm_dw,
    moe_grouped_gemm_dw_torch,
    moe_grouped_gemm_dx,
    moe_grouped_gemm_dx_torch,
)
from qmoe_doctor.kernels.grouped_gemm import GemmConfig, moe_grouped_gemm, moe_grouped_gemm_torch
from qmoe_doctor.kernels.testing import rel_err

KERNELS = Path(gg.__file__).resolve().parent
#: Our host modules: a host read made from one of these frames is a synchronization we added.
HOST_MODULES = {KERNELS / name for name in ("grouped_gemm.py", "backward.py", "dw_overlap.py", "launch.py", "combine.py")}
PLAIN_TRITON_RUN = L._plain_triton_run
#: Tensor methods that read device memory on the host (each synchronizes on a GPU).
HOST_READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every host read of a tensor made directly from our host modules, as "module:line
    method" (the interpreter's own reads, from triton's frames, are not ours)."""
    seen: list[str] = []

    def spy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            path = Path(caller.f_code.co_filename).resolve()
            if path in HOST_MODULES:
                seen.append(f"{path.name}:{caller.f_lineno} {name}")
            return original(self, *args, **kwargs)

        return wrapper

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    yield seen


def _operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 32, generator=gen)
    w = torch.randn(3, 24, 32, generator=gen)
    dy = torch.randn(40, 24, generator=gen)
    return x, w, dy, torch.tensor([10, 0, 30], dtype=torch.int32)


CALLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "forward": lambda x, w, dy, s: moe_grouped_gemm(x, w, s),
    "dx": lambda x, w, dy, s: moe_grouped_gemm_dx(dy, w, s),
    "dw": lambda x, w, dy, s: moe_grouped_gemm_dw(dy, x, s),
}
TWINS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "forward": lambda x, w, dy, s: moe_grouped_gemm_torch(x.double(), w.double(), s),
    "dx": lambda x, w, dy, s: moe_grouped_gemm_dx_torch(dy.double(), w.double(), s),
    "dw": lambda x, w, dy, s: moe_grouped_gemm_dw_torch(dy.double(), x.double(), s),
}


@pytest.mark.parametrize("op", list(CALLS))
def test_second_call_hits_the_plan_and_reads_nothing_on_the_host(
    op: str, host_reads: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gg.clear_plans()
    bw._DW_PLANS.clear()
    x, w, dy, sizes = _operands()
    first = CALLS[op](x, w, dy, sizes)
    hits, misses = gg.plan_stats.hits, gg.plan_stats.misses

    def no_planning(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a steady-state call planned again")

    for name in ("_make_gemm_plan", "pick_config", "check_operands", "tma_plan", "grid_size"):
        monkeypatch.setattr(gg, name, no_planning)
    for name in ("_make_dw_plan", "pick_dw_config", "check_dw_operands", "dw_tma_plan", "dw_grid_size"):
        monkeypatch.setattr(bw, name, no_planning)
    # new tensors of the same layout, other values: the plan holds no tensor of the first call
    x2, w2, dy2, _ = _operands(seed=1)
    sizes2 = torch.tensor([25, 15, 0], dtype=torch.int32)
    second = CALLS[op](x2, w2, dy2, sizes2)
    assert (gg.plan_stats.hits, gg.plan_stats.misses) == (hits + 1, misses)
    assert host_reads == [], host_reads
    tol = tolerance("float32")
    assert rel_err(first, TWINS[op](x, w, dy, sizes)) < tol
    assert rel_err(second, TWINS[op](x2, w2, dy2, sizes2)) < tol


def test_the_host_read_spy_can_see_a_read(host_reads: list[str]) -> None:
    """The fixture must be able to fail: ``check_routing=True`` reads m_sizes on purpose."""
    x, w, _, sizes = _operands()
    moe_grouped_gemm(x, w, sizes, check_routing=True)
    assert any("grouped_gemm.py" in seen for seen in host_reads), host_reads


def test_the_plan_key_separates_what_triton_specialises_on() -> None:
    """Another layout, dtype, config or alignment makes another plan; the same makes none."""
    gg.clear_plans()
    x, w, _, sizes = _operands()
    moe_grouped_gemm(x, w, sizes)
    moe_grouped_gemm(x.clone(), w.clone(), sizes.clone())
    assert len(gg._PLANS) == 1
    moe_grouped_gemm(torch.randn(41, 32), w, sizes)  # another M
    moe_grouped_gemm(x, w.transpose(1, 2).contiguous().transpose(1, 2), sizes)  # another stride
    moe_grouped_gemm(x, w, sizes, config=GemmConfig(16, 16, 16, 4, 1))
    offset = torch.zeros(4, dtype=torch.int32)
    unaligned = torch.cat([offset[:1], sizes])[1:]  # 4 bytes past a 16-byte boundary
    assert unaligned.data_ptr() % 16 != 0
    moe_grouped_gemm(x, w, unaligned)
    assert len(gg._PLANS) == 5


def test_the_plan_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    gg.clear_plans()
    monkeypatch.setattr(gg, "PLAN_LIMIT", 2)
    w, sizes = torch.randn(2, 8, 16), torch.tensor([3, 3], dtype=torch.int32)
    for m in (6, 7, 8):
        moe_grouped_gemm(torch.randn(m, 16), w, sizes)
    assert len(gg._PLANS) <= 2


# --------------------------------------------------------------------------------------------
# The compiled-kernel launcher, with a stand-in kernel
# --------------------------------------------------------------------------------------------


class _Compiled:
    def __init__(self, names: list[str]) -> None:
        self.function, self.packed_metadata = "fn", "meta"
        self.calls: list[tuple[Any, ...]] = []
        self.src = type("Src", (), {"fn": type("Fn", (), {"arg_names": names})()})()

    def run(self, *args: Any) -> None:
        self.calls.append(args)


class _Kernel:
    """A JITFunction's surface: arg_names, pre_run_hooks, kernel[grid](**kwargs) -> compiled."""

    arg_names = ["x_ptr", "M", "y_ptr", "BLOCK", "num_warps"]

    def __init__(self) -> None:
        self.pre_run_hooks: list[Any] = []
        self.compiled = _Compiled(self.arg_names)
        self.standard: list[tuple[tuple[int, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        def call(**kwargs: Any) -> Any:
            self.standard.append((grid, kwargs))
            return self.compiled

        return call


class _Hooks:
    def __init__(self) -> None:
        self.launch_enter_hook = type("HookChain", (), {"calls": []})()
        self.launch_exit_hook = type("HookChain", (), {"calls": []})()
        self.guarded: list[int] = []  # the device of every guard a launch took
        self.current = -1  # the current CUDA device as the launch sees it (-1: none of the plans')


@pytest.fixture
def gpu_like(monkeypatch: pytest.MonkeyPatch) -> _Hooks:
    """As on a GPU: the interpreter off, Triton's runtime a stand-in (hooks, current stream)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # Triton's own JITFunction.run (another test in this process may have wrapped it: a monitor)
    monkeypatch.setattr(L, "_plain_triton_run", lambda: True)
    hooks = _Hooks()
    monkeypatch.setattr(L._Runtime, "ready", True)
    monkeypatch.setattr(L._Runtime, "knobs", hooks)
    monkeypatch.setattr(L._Runtime, "stream", staticmethod(lambda index: 1000 + index))

    def guard(index: int) -> contextlib.AbstractContextManager[object]:
        hooks.guarded.append(index)
        return contextlib.nullcontext()

    monkeypatch.setattr(L, "_device_guard", guard)  # no CUDA here: the guard is recorded
    monkeypatch.setattr(L, "_current_device", lambda: hooks.current)
    return hooks


def test_later_calls_take_the_compiled_launcher_with_every_argument_in_order(gpu_like: _Hooks) -> None:
    kernel = _Kernel()
    launch = L.Launch(kernel, 7, {"M": 40, "BLOCK": 32, "num_warps": 8}, ("x_ptr", "y_ptr"), {"num_warps": 8, "num_stages": 3}, device_index=2)
    before = L.counts.lean
    launch("X1", "Y1")
    assert kernel.standard == [((7, 1, 1), {"x_ptr": "X1", "M": 40, "y_ptr": "Y1", "BLOCK": 32, "num_warps": 8, "num_stages": 3})]
    assert launch.lean
    launch("X2", "Y2")
    assert len(kernel.standard) == 1 and L.counts.lean == before + 1
    # CompiledKernel.run(gridX, gridY, gridZ, stream, function, packed_metadata, launch_metadata,
    # enter_hook, exit_hook, *every parameter in order)
    assert kernel.compiled.calls == [(7, 1, 1, 1002, "fn", "meta", None, None, None, "X2", 40, "Y2", 32, 8)]
    assert gpu_like.guarded == [2, 2]  # both launches inside the plan device's guard


def test_a_launch_enters_a_guard_only_when_another_device_is_current(gpu_like: _Hooks) -> None:
    """The guard is entered for a plan whose device is not current and skipped when it is;
    both calls reach the same launcher with the plan device's stream."""
    kernel = _Kernel()
    launch = L.Launch(kernel, 3, {"M": 8, "BLOCK": 16, "num_warps": 4}, ("x_ptr", "y_ptr"), {}, device_index=1)
    launch("X1", "Y1")  # compiles; device 1 is not current: guarded
    gpu_like.current = 1
    launch("X2", "Y2")  # device 1 current: no guard
    gpu_like.current = 0
    launch("X3", "Y3")  # another device current: guarded again
    assert gpu_like.guarded == [1, 1]
    assert [call[3] for call in kernel.compiled.calls] == [1001, 1001]  # device 1's stream both times
    assert [call[9] for call in kernel.compiled.calls] == ["X2", "X3"]


def test_a_launcher_that_refuses_the_arguments_sends_the_plan_back_to_triton(gpu_like: _Hooks) -> None:
    """A Triton whose launcher takes other arguments: the call is made through kernel[grid]
    instead, and so are all later calls of that plan; the refusal is counted with its reason."""
    kernel = _Kernel()

    def refuse(*args: Any) -> None:
        raise TypeError("function takes exactly 20 arguments (14 given)")

    kernel.compiled.run = refuse  # type: ignore[method-assign]
    launch = L.Launch(kernel, 1, {"M": 1, "BLOCK": 1, "num_warps": 4}, ("x_ptr", "y_ptr"), {}, device_index=0)
    launch("a", "b")
    launch("a", "b")
    launch("a", "b")
    assert len(kernel.standard) == 3 and not launch.lean
    assert L.counts.refused[-1].endswith("function takes exactly 20 arguments (14 given)")


def test_a_launch_hook_or_a_wrapped_run_keeps_every_call_on_triton(gpu_like: _Hooks, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = _Kernel()
    launch = L.Launch(kernel, 1, {"M": 1, "BLOCK": 1, "num_warps": 4}, ("x_ptr", "y_ptr"), {}, device_index=0)
    launch("a", "b")
    gpu_like.launch_enter_hook.calls.append(print)  # a profiler listens
    launch("a", "b")
    assert len(kernel.standard) == 2 and kernel.compiled.calls == []

    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def monitored(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, *args, **kwargs)

    monitored.__wrapped__ = original  # type: ignore[attr-defined]
    monkeypatch.setattr(JITFunction, "run", monitored)
    monkeypatch.setattr(L, "_plain_triton_run", PLAIN_TRITON_RUN)  # the real check, on the wrapped run
    gpu_like.launch_enter_hook.calls.clear()
    watched = L.Launch(kernel, 1, {"M": 1, "BLOCK": 1, "num_warps": 4}, ("x_ptr", "y_ptr"), {}, device_index=0)
    watched("a", "b")
    watched("a", "b")
    assert not watched.lean and kernel.compiled.calls == []


def test_the_escape_hatch_and_cpu_plans_stay_on_triton(gpu_like: _Hooks, monkeypatch: pytest.MonkeyPatch) -> None:
    from qmoe_doctor.core.knobs import QMOE_LEAN_LAUNCH as LEAN_LAUNCH_ENV

    kernel = _Kernel()
    args = {"M": 1, "BLOCK": 1, "num_warps": 4}
    cpu = L.Launch(kernel, 1, args, ("x_ptr", "y_ptr"), {}, device_index=-1)
    monkeypatch.setenv(LEAN_LAUNCH_ENV, "0")
    off = L.Launch(kernel, 1, args, ("x_ptr", "y_ptr"), {}, device_index=0)
    for launch in (cpu, off):
        launch("a", "b")
        launch("a", "b")
        assert not launch.lean
    assert kernel.compiled.calls == []


def test_a_launch_names_every_parameter_or_refuses() -> None:
    with pytest.raises(TypeError, match=r"missing \['BLOCK'\]"):
        L.Launch(_Kernel(), 1, {"M": 1, "num_warps": 4}, ("x_ptr", "y_ptr"), {}, device_index=-1)
    with pytest.raises(TypeError, match=r"unknown arguments \['Q'\]"):
        L.Launch(_Kernel(), 1, {"M": 1, "BLOCK": 1, "num_warps": 4, "Q": 0}, ("x_ptr", "y_ptr"), {}, device_index=-1)


# --------------------------------------------------------------------------------------------
# The direct call of the C launcher under Triton's Python launcher (a stand-in of Triton 3.6's)
# --------------------------------------------------------------------------------------------


class _Desc:
    """A host tensor descriptor's surface as Triton's launcher reads it (a plan's template)."""

    def __init__(self, base: Any, shape: list[int], strides: list[int]) -> None:
        self.base, self.shape, self.strides, self.padding = base, shape, strides, "zero"


class _Encoder:
    """``make_tensordesc_arg(arg, metadata)``: an encoding that names the address and block it
    was made for, and the addresses of the encodings made."""

    def __init__(self) -> None:
        self.made: list[int] = []

    def __call__(self, desc: Any, meta: Any) -> list[Any]:
        self.made.append(desc.base.data_ptr())
        return [f"map@{desc.base.data_ptr()}/{meta['block_size']}", *desc.shape, *desc.strides]


class _CFunction:
    """A launcher of Triton's C module: a callable without Python code."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _wrapped(launcher: Callable[..., Any]) -> Callable[..., Any]:
    """A closure of Triton 3.6's ``wrap_handle_tensordesc`` shape: ``inner`` over
    (launcher, tensordesc_indices, tensordesc_meta)."""
    tensordesc_indices: set[int] = set()
    tensordesc_meta: list[Any] = []

    def inner(*args: Any) -> Any:
        return launcher(*args), tensordesc_indices, tensordesc_meta

    return inner


class CudaLauncher:
    """A stand-in with the name and attributes of Triton 3.6's launcher; ``run`` is also what
    the compiled kernel's own launch would do (recorded)."""

    def __init__(self, launch: Callable[..., Any], scratch: int = 0) -> None:
        self.launch = launch
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = False
        self.launch_pdl = True
        self.runs: list[tuple[Any, ...]] = []

    def __call__(self, *args: Any) -> None:
        self.runs.append(args)


class _DescKernel(_Kernel):
    arg_names = ["y_ptr", "x_desc", "M", "w_desc", "BLOCK"]


SIGNATURE = ["*bf16", "tensordesc<bf16[64, 64]>", "i32", "tensordesc<bf16[128, 64]>", "constexpr"]
META = [{"block_size": [64, 64], "fp4_padded": False}, {"block_size": [128, 64], "fp4_padded": False}]


def _compiled_with(run: Any, signature: list[str], meta: list[Any] | None) -> Any:
    compiled = _Compiled(["a"] * len(signature))
    compiled.run = run  # type: ignore[method-assign]
    compiled.src.signature = {f"p{i}": ty for i, ty in enumerate(signature)}
    compiled.metadata = type("Meta", (), {"tensordesc_meta": meta})()
    return compiled


@pytest.fixture
def triton36(monkeypatch: pytest.MonkeyPatch) -> _Encoder:
    """Triton's NVIDIA driver module with 3.6's launcher layout (whatever Triton is installed)."""
    from triton.backends.nvidia import driver as nvidia

    encoder = _Encoder()

    def make_tensordesc_arg(arg: Any, metadata: Any) -> list[Any]:
        return encoder(arg, metadata)

    monkeypatch.setattr(nvidia, "_BASE_ARGS_FORMAT", L._C_BASE_FORMAT, raising=False)
    monkeypatch.setattr(nvidia, "make_tensordesc_arg", make_tensordesc_arg)
    return encoder


def _desc_launch(run: CudaLauncher) -> tuple[L.Launch, _DescKernel]:
    kernel = _DescKernel()
    kernel.compiled = _compiled_with(run, SIGNATURE, META)
    templates = {"x_desc": _Desc(None, [8, 4], [4, 1]), "w_desc": _Desc(None, [16, 4], [4, 1])}
    launch = L.Launch(
        kernel, 3, {"M": 8, "BLOCK": 64}, ("y_ptr", "x_desc", "w_desc"), {}, device_index=0, descriptors=templates
    )
    return launch, kernel


def test_the_c_launcher_gets_what_tritons_wrapper_would_build_and_encodings_are_kept(gpu_like: _Hooks, triton36: _Encoder) -> None:
    """After the first call (through kernel[grid], each descriptor template over its tensor),
    calls go to the C launcher: Triton's 13 base arguments, each tensor as its address, each
    descriptor expanded in place to (encoding, *shape, *strides); an address seen before reuses
    its encoding, a new address gets its own."""
    received: list[tuple[Any, ...]] = []
    run = CudaLauncher(_wrapped(lambda *a: received.append(a)))
    launch, kernel = _desc_launch(run)
    x1, x2, w, y = torch.zeros(8, 4), torch.zeros(8, 4), torch.zeros(2, 8, 4), torch.zeros(8)
    direct_before = L.counts.direct
    launch(y, x1, w)
    (_, first), = kernel.standard
    assert first["x_desc"].base is x1 and first["x_desc"].shape == [8, 4] and first["w_desc"].base is w
    assert launch.direct
    launch(y, x1, w)
    base = (3, 1, 1, 1000, "fn", False, True, None, None, "meta", None, None, None)
    assert received[-1] == (
        *base, y.data_ptr(), f"map@{x1.data_ptr()}/[64, 64]", 8, 4, 4, 1, 8, f"map@{w.data_ptr()}/[128, 64]", 16, 4, 4, 1, 64,
    )  # fmt: skip
    launch(y, x1, w)
    assert sorted(triton36.made) == sorted([x1.data_ptr(), w.data_ptr()])  # both kept
    launch(y, x2, w)
    assert triton36.made[-1] == x2.data_ptr() and len(triton36.made) == 3
    assert received[-1][14] == f"map@{x2.data_ptr()}/[64, 64]"
    launch(y, x1, w)
    assert received[-1][14] == f"map@{x1.data_ptr()}/[64, 64]" and len(triton36.made) == 3
    assert L.counts.direct == direct_before + 4 and run.runs == []


def test_kept_encodings_are_bounded(gpu_like: _Hooks, triton36: _Encoder) -> None:
    launch, _ = _desc_launch(CudaLauncher(_wrapped(lambda *a: None)))
    w, y = torch.zeros(2, 8, 4), torch.zeros(8)
    keep = [torch.zeros(8, 4) for _ in range(L.DESCRIPTOR_ENCODINGS_KEPT + 5)]
    for x in keep:
        launch(y, x, w)
    assert launch._direct is not None
    assert all(len(kept) <= L.DESCRIPTOR_ENCODINGS_KEPT for *_, kept in launch._direct._fills)
    # the first call goes through kernel[grid]: every later x encoded once, w once
    assert len(triton36.made) == (len(keep) - 1) + 1


def test_an_unknown_launcher_layout_is_called_as_it_is(triton36: _Encoder) -> None:
    """Only Triton 3.6's layout goes direct: a launcher of another name, one that needs a
    scratch buffer, a wrapper of another shape, another base format, a signature of another
    length or a descriptor without TMA metadata keeps the compiled kernel's own ``run``."""
    from triton.backends.nvidia import driver as nvidia

    ok = _wrapped(lambda *a: None)
    assert L._launcher_parts(_compiled_with(CudaLauncher(ok), SIGNATURE, META), len(SIGNATURE)) is not None
    assert L._launcher_parts(_Compiled(["a"]), 1) is None  # run is a plain method
    assert L._launcher_parts(_compiled_with(CudaLauncher(ok, scratch=64), SIGNATURE, META), len(SIGNATURE)) is None

    def other(*args: Any) -> None:
        return None

    assert L._launcher_parts(_compiled_with(CudaLauncher(other), SIGNATURE, META), len(SIGNATURE)) is None
    assert L._launcher_parts(_compiled_with(CudaLauncher(ok), SIGNATURE, META), len(SIGNATURE) + 1) is None
    assert L._launcher_parts(_compiled_with(CudaLauncher(ok), SIGNATURE, META[:1]), len(SIGNATURE)) is None
    assert L._launcher_parts(_compiled_with(CudaLauncher(ok), SIGNATURE, None), len(SIGNATURE)) is None
    nvidia._BASE_ARGS_FORMAT = "iiiKKOOOO"  # type: ignore[attr-defined]
    assert L._launcher_parts(_compiled_with(CudaLauncher(ok), SIGNATURE, META), len(SIGNATURE)) is None


def test_a_refused_direct_launch_goes_through_the_compiled_kernels_run(gpu_like: _Hooks, triton36: _Encoder) -> None:
    """A C launcher that refuses its arguments: that call and the later ones go through the
    compiled kernel's own run, with the descriptor templates over this call's tensors."""

    def refuse(*args: Any) -> None:
        raise TypeError("function takes exactly 30 arguments (18 given)")

    run = CudaLauncher(_wrapped(refuse))
    launch, kernel = _desc_launch(run)
    x, w, y = torch.zeros(8, 4), torch.zeros(2, 8, 4), torch.zeros(8)
    launch(y, x, w)
    launch(y, x, w)
    launch(y, x, w)
    assert len(kernel.standard) == 1 and launch.lean and not launch.direct and len(run.runs) == 2
    args = run.runs[-1][9:]
    assert args[0] is y and args[1].base is x and args[3].base is w and args[1].shape == [8, 4]
    assert L.counts.refused[-1].endswith("(18 given)")


def test_a_launch_observer_is_handed_the_direct_launch(gpu_like: _Hooks, triton36: _Encoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under qmoe-doctor run's monitor the lean call hands the observer the direct launch: the
    tensors it is told of are the call's (a descriptor's tensor, not a descriptor), and
    ``launcher(*call)`` reaches the C launcher."""
    from qmoe_doctor.core import launch_observer

    received: list[tuple[Any, ...]] = []
    seen: list[tuple[Any, ...]] = []

    def observer(kernel: Any, grid: Any, device: int, stream: int, names: Any, values: Any, launcher: Any, call: Any) -> None:
        seen.append((grid, device, stream, names, values))
        launcher(*call)

    launch, _ = _desc_launch(CudaLauncher(_wrapped(lambda *a: received.append(a))))
    x, w, y = torch.zeros(8, 4), torch.zeros(2, 8, 4), torch.zeros(8)
    launch(y, x, w)
    monkeypatch.setattr(launch_observer, "observer", observer)
    launch(y, x, w)
    assert seen == [((3, 1, 1), 0, 1000, ("y_ptr", "x_desc", "w_desc"), (y, x, w))]
    assert len(received) == 1 and received[0][13:15] == (y.data_ptr(), f"map@{x.data_ptr()}/[64, 64]")


def test_a_plan_without_descriptors_goes_direct_with_addresses(gpu_like: _Hooks, triton36: _Encoder) -> None:
    kernel = _Kernel()
    received: list[tuple[Any, ...]] = []
    kernel.compiled = _compiled_with(CudaLauncher(_CFunction(lambda *a: received.append(a))), ["*fp32", "i32", "*fp32", "constexpr", "constexpr"], None)
    launch = L.Launch(kernel, 7, {"M": 40, "BLOCK": 32, "num_warps": 8}, ("x_ptr", "y_ptr"), {}, device_index=0)
    x, y = torch.zeros(4), torch.zeros(4)
    launch(x, None)
    launch(x, y)
    launch(x, None)  # an absent optional tensor stays None (a null pointer to the launcher)
    assert received == [
        (7, 1, 1, 1000, "fn", False, True, None, None, "meta", None, None, None, x.data_ptr(), 40, y.data_ptr(), 32, 8),
        (7, 1, 1, 1000, "fn", False, True, None, None, "meta", None, None, None, x.data_ptr(), 40, None, 32, 8),
    ]


def test_rebase_copies_a_descriptor_onto_another_tensor() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    a, b = torch.zeros(4, 16, dtype=torch.float16), torch.ones(4, 16, dtype=torch.float16)
    desc = TensorDescriptor(a, [4, 16], [16, 1], [4, 16])
    template = L.rebase(desc, None)
    moved = L.rebase(template, b)
    assert moved.base is b and template.base is None and desc.base is a
    assert (moved.shape, moved.strides, moved.block_shape) == (desc.shape, desc.strides, desc.block_shape)
