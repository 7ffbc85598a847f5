"""Row gathers and weighted segment sums without atomics: the glue of the MoE block.

The block moves rows between token order and expert order twice: ``x = hidden[token_idx]``
(each token copied to its k rows) and ``out[t] = sum_k w[t, k] * down[row(t, k)]``. The obvious
torch ops are ``hidden[token_idx]`` and ``out.index_add_(0, token_idx, down * w)``; on an H200
the bf16 ``index_add_`` (atomics) alone took 4.6 ms of a 26.8 ms forward+backward of the 30B
block at 32,768 tokens, and the backward of the gather (``index_put_`` with accumulate) 1.5 ms.

Both are segment sums over a fixed grouping: ``order`` lists, segment by segment, which row
belongs to each position, ``starts`` (S + 1) bounds the segments. ``segment_sum`` sums (and
optionally weights) the rows of each segment in float32 and writes each output row once;
``CombineRows`` / ``GatherRows`` are the autograd functions built on it:

* ``combine_rows(rows, order, starts, weights)`` -> (S, H): forward a weighted segment sum;
  backward writes each row's gradient once (``w * grad[segment]``) and each weight's gradient
  (a dot product), no atomics;
* ``gather_rows(src, index, order, starts)`` -> ``src[index]``; backward the segment sum of the
  rows' gradients back to their source rows.

``order`` must be a permutation of the rows (every row in exactly one segment). Slow, obvious
twins: ``segment_sum_torch``. Kernels run on the rows' device inside its device guard; they are
in ``kernels/_details/combine_kernels.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from qmoe_doctor.kernels._details.combine_kernels import _combine_backward_kernel, _segment_sum_kernel
from qmoe_doctor.kernels.grouped_gemm import PLAN_LIMIT, _operand_key, device_guard
from qmoe_doctor.kernels.launch import Launch

__all__ = [
    "combine_rows",
    "gather_rows",
    "grouping",
    "segment_counts",
    "segment_starts",
    "segment_sum",
    "segment_sum_torch",
    "sum_rows",
]

BLOCK_H = 256


def segment_starts(counts: torch.Tensor) -> torch.Tensor:
    """(S + 1,) int64 bounds from (S,) counts, on their device (no synchronization)."""
    ends = torch.cumsum(counts.to(torch.int64), 0)
    return torch.cat([ends.new_zeros(1), ends])


def _check(
    rows: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor | None
) -> None:
    if rows.dim() != 2:
        raise ValueError(f"rows must be 2-D (R, H), got shape {tuple(rows.shape)}")
    if order.dim() != 1 or starts.dim() != 1 or starts.shape[0] < 1:
        raise ValueError("order must be 1-D and starts 1-D with at least one entry")
    if weights is not None and weights.shape != order.shape:
        raise ValueError(f"weights {tuple(weights.shape)} must match order {tuple(order.shape)}")
    devices = {t.device for t in (rows, order, starts) if t is not None}
    if weights is not None:
        devices.add(weights.device)
    if len(devices) > 1:
        raise ValueError(
            f"rows, order, starts and weights must be on one device, got {sorted(map(str, devices))}"
        )


def segment_sum(
    rows: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """(S, H): out[s] = sum over j in [starts[s], starts[s+1]) of weights[j] * rows[order[j]].

    The MoE block calls it twice per step: its launch is a cached plan per operand layout
    (``grouped_gemm``'s launch plans), no check or argument binding repeated per call."""
    try:
        key: tuple[Any, ...] | None = (
            _operand_key(rows), _operand_key(order), _operand_key(starts),
            None if weights is None else _operand_key(weights),
        )  # fmt: skip
    except AttributeError:
        key = None
    plan = _SUM_PLANS.get(key) if key is not None else None
    if plan is None:
        _check(rows, order, starts, weights)
        plan = _SumPlan(rows, starts, weights)
        if key is not None:
            if len(_SUM_PLANS) >= PLAN_LIMIT:
                _SUM_PLANS.clear()
            _SUM_PLANS[key] = plan
    return plan.run(rows, order, starts, weights)


class _SumPlan:
    """One segment_sum layout: output shape, the launch, which operands need converting."""

    __slots__ = ("contiguous", "device", "dtype", "guard_index", "h", "launch", "segments")

    def __init__(self, rows: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor | None) -> None:
        self.contiguous = rows.stride(1) != 1  # the kernel walks a row with stride 1
        self.segments = starts.shape[0] - 1
        self.h = rows.shape[1]
        self.device, self.dtype = rows.device, rows.dtype
        self.guard_index = (
            (rows.device.index if rows.device.index is not None else torch.cuda.current_device())
            if rows.device.type == "cuda"
            else -1
        )
        self.launch: Launch | None = None
        if self.segments and self.h:
            stride_r = rows.stride(0) if not self.contiguous else self.h
            self.launch = Launch(
                _segment_sum_kernel,
                (self.segments, triton.cdiv(self.h, BLOCK_H)),
                {"H": self.h, "stride_r": stride_r, "stride_o": self.h, "HAS_W": weights is not None, "BLOCK_H": BLOCK_H},
                ("rows_ptr", "order_ptr", "starts_ptr", "w_ptr", "out_ptr"),
                {},
                device_index=self.guard_index,
            )

    def run(
        self, rows: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor | None
    ) -> torch.Tensor:
        if self.contiguous:
            rows = rows.contiguous()
        out = torch.empty((self.segments, self.h), device=self.device, dtype=self.dtype)
        if self.launch is not None:  # it holds the rows' device guard
            self.launch(
                rows, order.to(torch.int64), starts.to(torch.int64), weights if weights is not None else rows, out
            )
        return out


_SUM_PLANS: dict[tuple[Any, ...], _SumPlan] = {}


def segment_sum_torch(
    rows: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """The slow, obvious twin (float32 accumulation, a loop over segments)."""
    out = torch.zeros((starts.shape[0] - 1, rows.shape[1]), dtype=torch.float32, device=rows.device)
    bounds = starts.tolist()
    for s in range(len(bounds) - 1):
        for j in range(bounds[s], bounds[s + 1]):
            w = 1.0 if weights is None else float(weights[j])
            out[s] += w * rows[int(order[j])].float()
    return out.to(rows.dtype)


class CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(rows, order, starts, weights)
        return segment_sum(rows, order, starts, weights)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        rows, order, starts, weights = ctx.saved_tensors
        rows_c = rows if rows.stride(1) == 1 and rows.is_contiguous() else rows.contiguous()
        grad = grad.contiguous()
        with device_guard(rows.device):
            grad_rows = torch.empty_like(rows_c)
            grad_w = torch.empty_like(weights)
            segments = starts.shape[0] - 1
            if segments and rows.shape[1]:
                _combine_backward_kernel[(segments,)](
                    grad,
                    rows_c,
                    order.to(torch.int64),
                    starts.to(torch.int64),
                    weights,
                    grad_rows,
                    grad_w,
                    rows.shape[1],
                    grad.stride(0),
                    rows_c.stride(0),
                    BLOCK_H=BLOCK_H,
                )
            else:
                grad_rows.zero_()
                grad_w.zero_()
        return grad_rows, None, None, grad_w


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, src: torch.Tensor, index: torch.Tensor, order: torch.Tensor, starts: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(order, starts)
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        order, starts = ctx.saved_tensors
        return segment_sum(grad, order, starts), None, None, None


class SumRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, index: torch.Tensor, order: torch.Tensor, starts: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(index)
        return segment_sum(rows, order, starts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None, None


def sum_rows(
    rows: torch.Tensor, index: torch.Tensor, order: torch.Tensor, starts: torch.Tensor
) -> torch.Tensor:
    """Differentiable unweighted segment sum: row i belongs to segment ``index[i]`` (its
    backward is the gather ``grad[index]``); ``order``/``starts`` list the rows per segment."""
    _check(rows, order, starts, None)
    out: torch.Tensor = SumRows.apply(rows, index, order, starts)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
    return out


def segment_counts(index: torch.Tensor, segments: int) -> torch.Tensor:
    """(S,) int64 rows per segment of ``index`` (values in [0, S)), on its device, without a
    host synchronization (``torch.bincount`` on a GPU reads the largest index on the host first:
    one stall per call, which the expert-parallel forward cannot afford several times a step)."""
    counts = torch.zeros(segments, dtype=torch.int64, device=index.device)
    return counts.index_add_(
        0, index.to(torch.int64), torch.ones(index.shape, dtype=torch.int64, device=index.device)
    )


def grouping(index: torch.Tensor, segments: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, starts) of rows grouped by ``index`` (row i in segment index[i]), stable; no
    host synchronization."""
    order = torch.argsort(index, stable=True)
    return order, segment_starts(segment_counts(index, segments))


def combine_rows(
    rows: torch.Tensor, order: torch.Tensor, starts: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Differentiable weighted segment sum (in rows and weights); see the module docstring."""
    _check(rows, order, starts, weights)
    out: torch.Tensor = CombineRows.apply(rows, order, starts, weights)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
    return out


def gather_rows(
    src: torch.Tensor, index: torch.Tensor, order: torch.Tensor, starts: torch.Tensor
) -> torch.Tensor:
    """``src[index]`` whose backward sums each source row's gradients without atomics: segment s
    (source row s) holds the gathered rows ``order[starts[s]:starts[s+1]]``."""
    out: torch.Tensor = GatherRows.apply(src, index, order, starts)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
    return out
