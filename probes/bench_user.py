"""``qmoe-doctor bench --kernel REF``: the user's kernel in the same table and plot as ours,
``torch._grouped_mm`` and dense (child side; torch).

REF is any ``--kernel`` form (``qmoe_doctor.core.kernel_ref.KernelRef``: a file, a module, an
adapter, a specimen, ``torch:grouped_mm``); ``load_user_kernel`` resolves it the way the probes do
(``probes/loader.load_kernel``) and returns a :class:`UserKernel`, whose rows the benchmark child
(``probes/bench.py``) adds beside ours:

* forward: ``fn(x, w, m_sizes)``, as every probe calls a kernel;
* dx: ``fn(dy, w_t, m_sizes)`` with ``w_t = w.transpose(1, 2)`` made contiguous ONCE, outside the
  timing (the forward signature computes dx on the transposed stack; a kernel that takes strided
  weights would not need the copy, but many assert contiguity);
* dw: none (the signature has no weight gradient);
* the MoE block: ``MoEBlock(kernel=fn)`` (its backward is always ours), eager and from a CUDA graph.

A kernel whose adapter declares it cannot take this run's operands (a dtype, CPU tensors) gets
its rows with the reason as their note (:class:`UserKernelSkipped`), never a crash of the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from qmoe_doctor.core.kernel_ref import KernelRef, RefKind
from qmoe_doctor.probes.adapters import AdaptedKernel, KernelLimits
from qmoe_doctor.probes.loader import KernelFn, as_ref, load_kernel

__all__ = ["UserKernel", "UserKernelSkipped", "impl_label", "load_user_kernel"]

#: The longest kernel name the table's implementation column shows (a path is shortened).
LABEL_MAX = 40


class UserKernelSkipped(Exception):
    """This run's operands are outside what the kernel's adapter declares: the row's note."""


def impl_label(ref: KernelRef) -> str:
    """The implementation name of the user's rows: ``kernel <ref>``, a file shown by its name."""
    text = str(ref)
    if ref.kind is RefKind.FILE:
        text = f"{ref.path.name}:{ref.attr}"
    if len(text) > LABEL_MAX:
        text = "…" + text[-(LABEL_MAX - 1) :]
    return f"kernel {text}"


@dataclass(frozen=True, slots=True, kw_only=True)
class UserKernel:
    ref: str  # the canonical KernelRef text (what the report's command repeats)
    label: str  # the implementation name of its GEMM rows
    fn: KernelFn
    limits: KernelLimits

    @property
    def block_label(self) -> str:
        """The implementation name of its MoE block rows."""
        return f"MoEBlock + {self.label}"

    def skip_reason(self, x: torch.Tensor) -> str:
        """Why this kernel cannot take operands like ``x`` ("" when it can)."""
        dtype = str(x.dtype).removeprefix("torch.")
        if self.limits.dtypes is not None and dtype not in self.limits.dtypes:
            return f"{self.ref} declares dtypes {sorted(self.limits.dtypes)}; this run is {dtype}"
        if x.device.type == "cpu" and not self.limits.supports_cpu:
            return f"{self.ref} declares no CPU path (the --tiny run is on the CPU)"
        return ""

    def forward(self, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The forward call to time: ``fn(x, w, m_sizes)``."""
        reason = self.skip_reason(x)
        if reason:
            return _skipped(reason)
        fn = self.fn
        return lambda: fn(x, w, m_sizes)

    def dx(self, dy: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> Callable[[], torch.Tensor]:
        """dx through the forward signature on the transposed stack (made contiguous here, once)."""
        reason = self.skip_reason(dy)
        if reason:
            return _skipped(reason)
        w_t = w.transpose(1, 2).contiguous()
        fn = self.fn
        return lambda: fn(dy, w_t, m_sizes)

    DX_NOTE = "dx as fn(dy, w.transpose(1, 2) made contiguous once, outside the timing, m_sizes)"


def _skipped(reason: str) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        raise UserKernelSkipped(reason)

    return call


def load_user_kernel(text: str | KernelRef) -> UserKernel:
    """The user's kernel, resolved in this child. Raises
    ``qmoe_doctor.probes.loader.KernelResolutionError`` (the parent validated the reference, so
    this is an import or signature failure of the user's code)."""
    ref = as_ref(text)
    fn = load_kernel(ref)
    limits = fn.limits if isinstance(fn, AdaptedKernel) else KernelLimits()
    return UserKernel(ref=str(ref), label=impl_label(ref), fn=fn, limits=limits)
