"""Guard rows around the output a kernel allocates for itself (child side; imports torch).

A kernel that allocates its own ``y`` leaves nothing for the probe to put a canary after: the
allocator trap (``conditions.OutputTrap``) gets the block right after y only when the caching
allocator happens to hand it out, and in every recorded GPU scan of the over-routed cell it did
not (``canary_after_output: false``), so a write past y went unseen. While the kernel runs under
an ``OutputGuard``, an allocation of exactly the output's shape through ``torch.empty``,
``torch.zeros``, ``Tensor.new_empty`` or ``Tensor.new_zeros`` is served as rows ``[g, g + M)`` of
a buffer of ``M + 2g`` rows: the ``g`` rows before and after hold a canary byte pattern, the
rows of ``y`` the poison of ``torch.empty`` (all-ones bytes: NaN) or zeros. The view has y's
shape, strides, dtype and device; only its storage is larger. After the call, a changed guard
byte is a write outside y ("before y", "after y"), on the CPU and on a GPU alike.

Any other allocation (another shape, ``out=``, a memory format, ``*_like``) goes through
untouched; a kernel whose output comes from elsewhere is reported as unguarded
(``canary_after_output`` stays as the trap found it) and the cell as unchecked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from qmoe_doctor.probes.context import ProbeContext

CANARY_BYTE = 0xA5  # finite in bf16, fp16 and fp32 (0xA5A5 / 0xA5A5A5A5)
POISON_BYTE = 0xFF  # all-ones is NaN in bf16, fp16 and fp32
_PLAIN_KWARGS = frozenset({"dtype", "device", "requires_grad", "layout"})


def _shape_of(size: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The shape a factory call asks for (``(M, N)``, ``M, N`` or a torch.Size), or None."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    try:
        return tuple(int(s) for s in size)
    except (TypeError, ValueError):
        return None


class OutputGuard:
    """Serve allocations of ``shape`` with guard rows around them while the block runs."""

    def __init__(self, shape: tuple[int, int], guard_rows: int) -> None:
        self.shape = (int(shape[0]), int(shape[1]))
        self.guard_rows = max(1, int(guard_rows))
        self.served: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, the view handed out)
        self._saved: list[tuple[Any, str, Any]] = []

    # -- the factories ---------------------------------------------------------------------

    def _serve(self, fill: str, dtype: Any, device: Any, requires_grad: bool) -> torch.Tensor:
        m, n = self.shape
        g = self.guard_rows
        empty = self._real_empty
        buf = empty((m + 2 * g, n), dtype=dtype, device=device)
        buf.view(torch.uint8).fill_(CANARY_BYTE)
        y = buf[g : g + m]
        if fill == "zeros":
            y.zero_()
        else:
            y.view(torch.uint8).fill_(POISON_BYTE)
        self.served.append((buf, y))
        return y.requires_grad_(True) if requires_grad else y

    def _factory(self, real: Callable[..., Any], fill: str) -> Callable[..., Any]:
        guard = self

        def make(*size: Any, **kwargs: Any) -> Any:
            if set(kwargs) <= _PLAIN_KWARGS and kwargs.get("layout", torch.strided) is torch.strided:
                if _shape_of(size) == guard.shape:
                    return guard._serve(
                        fill, kwargs.get("dtype"), kwargs.get("device"), bool(kwargs.get("requires_grad"))
                    )
            return real(*size, **kwargs)

        return make

    def _method(self, real: Callable[..., Any], fill: str) -> Callable[..., Any]:
        guard = self

        def make(tensor: torch.Tensor, *size: Any, **kwargs: Any) -> Any:
            if set(kwargs) <= _PLAIN_KWARGS and kwargs.get("layout", torch.strided) is torch.strided:
                if _shape_of(size) == guard.shape:
                    dtype = kwargs.get("dtype") or tensor.dtype
                    device = kwargs.get("device") or tensor.device
                    return guard._serve(fill, dtype, device, bool(kwargs.get("requires_grad")))
            return real(tensor, *size, **kwargs)

        return make

    def __enter__(self) -> OutputGuard:
        self._real_empty = torch.empty
        for owner, name, fill in (
            (torch, "empty", "empty"),
            (torch, "zeros", "zeros"),
            (torch.Tensor, "new_empty", "empty"),
            (torch.Tensor, "new_zeros", "zeros"),
        ):
            real = getattr(owner, name)
            self._saved.append((owner, name, real))
            wrap = self._factory(real, fill) if owner is torch else self._method(real, fill)
            setattr(owner, name, wrap)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()

    # -- after the call --------------------------------------------------------------------

    def served_for(self, y: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (buffer, view) behind the kernel's returned output, when it is one we served."""
        if not isinstance(y, torch.Tensor):
            return None
        for buf, view in self.served:
            if y.device == view.device and y.data_ptr() == view.data_ptr() and tuple(y.shape) == self.shape:
                return buf, view
        return None

    def report(self, ctx: ProbeContext, y: Any) -> list[str]:
        """Facts and canary hits for the output the kernel returned: ``output_guard`` says
        whether guard rows surrounded it."""
        found = self.served_for(y)
        ctx.fact("output_guard", found is not None)
        if found is None:
            return []
        buf, _ = found
        g, m = self.guard_rows, self.shape[0]
        ctx.fact("poisoned_output", True)
        ctx.fact("canary_after_output", True)
        ctx.fact("canary_before_output", True)
        ctx.fact("guard_rows", g)
        raw = buf.view(torch.uint8)
        hits = []
        before = raw[:g] != CANARY_BYTE
        after = raw[g + m :] != CANARY_BYTE
        if bool(before.any()):
            hits.append("before y")
            ctx.fact("rows_written_before_y", int(before.any(dim=1).sum()))
        if bool(after.any()):
            hits.append("after y")
            ctx.fact("rows_written_after_y", int(after.any(dim=1).sum()))
        return hits


__all__ = ["CANARY_BYTE", "POISON_BYTE", "OutputGuard"]
