"""The specimens: grouped GEMMs that calibrate the doctor, each planting one thing.

Pure data (no torch): the kernels themselves live in ``kernels/specimens/<module>.py``
(installed as ``qmoe_doctor.kernels.specimens``), each with the planted line marked
``# PLANTED:``. Most are a small diff from the correct ``grouped_gemm.moe_grouped_gemm`` that
plants one cause; others are written in the style of the public fused-MoE kernels users bring
(their own output allocation, contiguity asserts, a large autotune space, per-device state),
and some of those are *correct*: their ``cause`` is None and a scan must call them healthy.

A scan of a specimen (``--kernel specimen:NAME``) must name its cause and no other; each one is
right in the benign condition and wrong only under the conditions listed in
``misbehaves_under``. ``rejected_under`` lists the offset variants whose inputs the kernel
refuses loudly before launch (a contract, not a fault); ``lint_rule`` names the rule of
``qmoe-doctor lint`` that finds a cause no scan cell can see on identical GPUs. The verdict each
must get is the calibration table of ``docs/validation/scan-specimens.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from qmoe_doctor.core.records import Condition

#: Where the specimen modules live once installed (kernels/specimens/ in the repository).
SPECIMEN_PACKAGE = "qmoe_doctor.kernels.specimens"


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecimenInfo:
    name: str  # what --kernel specimen:NAME takes
    # the cause id it plants, a key of qmoe_doctor.core.causes.CAUSES; None: a correct kernel
    # (in a public kernel's style) that must come out healthy
    cause: str | None
    module: str  # module name inside SPECIMEN_PACKAGE
    function: str  # same signature as grouped_gemm.moe_grouped_gemm (x, w, m_sizes, *, out_dtype)
    summary: str  # one line: what it does wrong
    trigger: str  # one line: the condition under which it misbehaves
    # probe conditions under which the doctor must see it fail (error, wrong or slow); under
    # every other condition it must pass like the correct kernel
    misbehaves_under: tuple[Condition, ...]
    # offsets variants whose inputs the wrapper refuses before launch (cells labelled rejected)
    rejected_under: tuple[str, ...] = ()
    # the lint rule that names the cause where no scan cell can see it (identical GPUs)
    lint_rule: str | None = None
    # how the probes call it (``core.kernel_ref.Protocol``): ``m_sizes`` fn(x, w, m_sizes); the
    # routed specimens take the router's ids, fn(hidden_states, w, topk_ids, topk_weights,
    # expert_map=None), and return (T, N) ("routed") or (T*k, N) ("routed-rows")
    protocol: Literal["m_sizes", "routed", "routed-rows"] = "m_sizes"

    @property
    def kernel_option(self) -> str:
        """The value of ``--kernel`` that selects it."""
        return f"specimen:{self.name}"

    @property
    def ref(self) -> str:
        """``module:function`` import reference of the specimen's entry point."""
        return f"{SPECIMEN_PACKAGE}.{self.module}:{self.function}"


# A launch from another current device fails or crosses GPUs: every pair condition except the
# guarded baseline and, for an unguarded launch, the "untouched" accident (no context on a).
_CROSS_DEVICE = (Condition.NO_PEER, Condition.PEER, Condition.PRODUCER_RACE, Condition.SIZES_RACE)

SPECIMENS: tuple[SpecimenInfo, ...] = (
    SpecimenInfo(
        name="unguarded",
        cause="missing-device-guard",
        module="unguarded",
        function="moe_grouped_gemm",
        summary="no device guard around the launch; grid sized from the current device",
        trigger="current device != x.device (and its context exists)",
        misbehaves_under=_CROSS_DEVICE,
    ),
    SpecimenInfo(
        name="int32_offsets",
        cause="int32-offset-overflow",
        module="int32_offsets",
        function="moe_grouped_gemm",
        summary="expert * stride_we formed in int32 (no int64 cast on the expert index)",
        trigger="expert * N * K > 2**31 - 1 (160 experts of 5120x6144: expert 69 on)",
        misbehaves_under=(Condition.INT32_BOUNDARY,),
    ),
    SpecimenInfo(
        name="default_buffer",
        cause="default-device-buffer",
        module="default_buffer",
        function="moe_grouped_gemm",
        summary='output allocated with device="cuda" before the guard: lands on the current device',
        trigger="current device != x.device",
        misbehaves_under=(Condition.UNTOUCHED, *_CROSS_DEVICE),
    ),
    SpecimenInfo(
        name="wrong_stream",
        cause="wrong-device-stream",
        module="wrong_stream",
        function="moe_grouped_gemm",
        summary="guarded, but launched on the default stream instead of the caller's stream",
        trigger="caller's current stream is a side stream with x's producer still queued",
        misbehaves_under=(Condition.SIDE_STREAM,),
    ),
    SpecimenInfo(
        name="unmasked_rows",
        cause="invalid-routing",
        module="unmasked_rows",
        function="moe_grouped_gemm",
        summary="trusts m_sizes: no clamp of the row counts to [0, M - row_start]",
        trigger="sum(m_sizes) > M (reads past x, writes past y) or a -1 sentinel (rows shift)",
        misbehaves_under=(Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES),
    ),
    SpecimenInfo(
        name="autotune_inplace",
        cause="autotune-inplace-rerun",
        module="autotune_inplace",
        function="moe_grouped_gemm",
        summary="accumulating kernel autotuned without restore_value / reset_to_zero",
        trigger="first call per process for a shape: benchmark runs add into y",
        misbehaves_under=(Condition.REPEAT_CALL,),
    ),
    # Rank-level specimens (qmoe-doctor scan --parallel): the fault is in what a framework does
    # around the kernel in each rank, planted through a rank hook (probes/parallel/hooks.py).
    SpecimenInfo(
        name="rank_no_set_device",
        cause="device-never-set",
        module="rank_no_set_device",
        function="moe_grouped_gemm",
        summary="ranks never call torch.cuda.set_device; the wrapper allocates its output on the current device",
        trigger="any rank whose local rank is not 0: its current device stays cuda:0",
        misbehaves_under=(Condition.PARALLEL_DP, Condition.PARALLEL_TP, Condition.PARALLEL_EP),
    ),
    # In the style of the public fused-MoE kernels (FINDINGS.md, "Measured on one H100 ...
    # 2026-11-25"): each plants one of that design's traits.
    SpecimenInfo(
        name="running_row_mask",
        cause="invalid-routing",
        module="running_row_mask",
        function="moe_grouped_gemm",
        summary="allocates its own y; masks rows by the running expert count, never by M",
        trigger="sum(m_sizes) > M, or a -1 sentinel read as 0 (counts then sum to M + 1): writes past y",
        misbehaves_under=(Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES),
    ),
    SpecimenInfo(
        name="contiguous_only",
        cause=None,
        module="contiguous_only",
        function="moe_grouped_gemm",
        summary="correct; its wrapper asserts x, w and m_sizes are contiguous",
        trigger="never wrong: strided inputs are refused (AssertionError) before any launch",
        misbehaves_under=(),
        rejected_under=("padded-rows", "transposed-w"),
    ),
    SpecimenInfo(
        name="autotuned",
        cause=None,
        module="autotuned",
        function="moe_grouped_gemm",
        summary="correct; @triton.autotune over 1,000 configs, pruned per shape, keyed on M, N, K",
        trigger="never wrong; the first call per key benchmarks the pruned configs (slow, restore-safe)",
        misbehaves_under=(),
    ),
    SpecimenInfo(
        name="cached_sms",
        cause="per-device-state-cached",
        module="cached_sms",
        function="moe_grouped_gemm",
        summary="SM count read once from the current device and kept in a module global",
        trigger="GPUs of different SM counts (the grid is sized for the first device); none on identical GPUs",
        misbehaves_under=(),
        lint_rule="cached-device-property",
    ),
    SpecimenInfo(
        name="global_expert_ids",
        cause="invalid-routing",
        module="global_expert_ids",
        function="moe_grouped_gemm",
        summary="expert parallelism without the global -> local expert id remap",
        trigger="expert parallelism: every rank but the first gets ids past its local weight stack",
        misbehaves_under=(Condition.PARALLEL_EP,),
    ),
    # The persistent TMA-descriptor design (issue #41): device-side descriptors
    # (tl.make_tensor_descriptor, scratch from triton.set_allocator), a grid of the SM count,
    # 64-bit row offsets, w flattened to (E*N, K). One correct twin, two faults planted in it.
    SpecimenInfo(
        name="tma_persistent",
        cause=None,
        module="tma_persistent",
        function="moe_grouped_gemm",
        summary="correct; persistent grid, device-side TMA descriptors (scratch from triton.set_allocator), w as (E*N, K)",
        trigger="never wrong: rows clamped to M, unaligned operands copied, launch, grid and scratch on x's device",
        misbehaves_under=(),
    ),
    SpecimenInfo(
        name="tma_unmasked_rows",
        cause="invalid-routing",
        module="tma_unmasked_rows",
        function="moe_grouped_gemm",
        summary="TMA style; each expert's x and y descriptors span the rows m_sizes claims, never clamped to M",
        trigger="sum(m_sizes) > M: TMA stores past y (a program dies of an illegal instruction); a -1 sentinel shifts rows",
        misbehaves_under=(Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES),
    ),
    SpecimenInfo(
        name="tma_misaligned",
        cause="misaligned-operand",
        module="tma_misaligned",
        function="moe_grouped_gemm",
        summary="TMA style; descriptors made on x without checking the 16-byte alignment of its base and strides",
        trigger="x not 16-byte aligned (a view 1 element into its storage): CUDA error: misaligned address",
        misbehaves_under=(Condition.OFFSETS,),
    ),
)

# The routed protocol (issue #45), two public styles written by us: kernels that take the
# router's token ids (fn(hidden_states, w, topk_ids, topk_weights, expert_map=None)) and route
# inside. One correct twin per style, one fault planted in each of the others.
_ROUTED_EDGE_CELLS = (
    Condition.IDS_OUT_OF_RANGE,
    Condition.DROPPED_SLOTS,
    Condition.EXPERT_MAP,
    Condition.MAP_PAST_LOCAL,
)
SPECIMENS += (
    SpecimenInfo(
        name="sorted_ids",
        cause=None,
        module="sorted_ids",
        function="fused_moe",
        summary="correct; sorted-token-ids style: an alignment to BLOCK_M blocks, a kernel gathering rows per block, (T*k, N) out",
        trigger="never wrong: ids and map entries masked by E, the grid from the buffer, int64 slot ids",
        misbehaves_under=(),
        protocol="routed-rows",
    ),
    SpecimenInfo(
        name="sorted_padded_count",
        cause="invalid-routing",
        module="sorted_padded_count",
        function="fused_moe",
        summary="sorted-token-ids style; its grid from num_tokens_post_padded (read on the host), not the buffer",
        trigger="num_tokens_post_padded past the padded buffer: blocks read past sorted_token_ids and expert_ids",
        misbehaves_under=(Condition.PADDED_COUNT,),
        protocol="routed-rows",
    ),
    SpecimenInfo(
        name="sorted_minus_one",
        cause="invalid-routing",
        module="sorted_minus_one",
        function="fused_moe",
        summary="sorted-token-ids style; a block of expert -1 (slots routed nowhere) read as expert -1",
        trigger="any slot routed nowhere (-1, an id past E, a remote or out-of-range map entry): reads w[-1]",
        misbehaves_under=_ROUTED_EDGE_CELLS,
        protocol="routed-rows",
    ),
    SpecimenInfo(
        name="sorted_int32_token",
        cause="int32-offset-overflow",
        module="sorted_int32_token",
        function="fused_moe",
        summary="sorted-token-ids style; slot ids loaded as int32: slot * stride_om formed in int32",
        trigger="T*k*N past 2**31 (1M tokens of top-8 at N = 256): the last rows wrap, 4 GiB before out",
        misbehaves_under=(Condition.GATHERED_INT32,),
        protocol="routed-rows",
    ),
    SpecimenInfo(
        name="gather_scatter",
        cause=None,
        module="gather_scatter",
        function="ragged_moe",
        summary="correct; gather/scatter style: a histogram per expert, gather/scatter indices, a persistent ragged matmul",
        trigger="never wrong: ids masked by E, gather indices by T*k, the grid from the operands' device",
        misbehaves_under=(),
        protocol="routed",
    ),
    SpecimenInfo(
        name="gather_unchecked_ids",
        cause="invalid-routing",
        module="gather_unchecked_ids",
        function="ragged_moe",
        summary="gather/scatter style; ids never checked against E, the histogram a bincount that grows past E",
        trigger="an id (or expert_map entry) past E: the ragged matmul walks experts past the end of w",
        misbehaves_under=(Condition.IDS_OUT_OF_RANGE, Condition.MAP_PAST_LOCAL),
        protocol="routed",
    ),
    SpecimenInfo(
        name="gather_past_t",
        cause="invalid-routing",
        module="gather_past_t",
        function="ragged_moe",
        summary="gather/scatter style; gather indices masked by the row range only, never by T*k",
        trigger="a gather index naming a token past T: reads a row past hidden_states",
        misbehaves_under=(Condition.GATHER_PAST_T,),
        protocol="routed",
    ),
    SpecimenInfo(
        name="gather_sms_device0",
        cause="per-device-state-cached",
        module="gather_sms_device0",
        function="ragged_moe",
        summary="gather/scatter style; its persistent grid from device 0's SM count, kept in a module global",
        trigger="device 0 of another SM count than the operands' (two GPU models, CUDA_VISIBLE_DEVICES "
        "reordering); none on identical GPUs",
        misbehaves_under=(),
        lint_rule="cached-device-property",
        protocol="routed",
    ),
)

_BY_NAME = {s.name: s for s in SPECIMENS}


def get_specimen(name: str) -> SpecimenInfo:
    """The specimen called ``name``; a KeyError that lists the known names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown specimen {name!r}; known specimens: {', '.join(_BY_NAME)}") from None


def faulty_specimens() -> tuple[SpecimenInfo, ...]:
    """The specimens that plant a cause (the others are correct kernels in a public style)."""
    return tuple(s for s in SPECIMENS if s.cause is not None)


def kernel_ref(name: str) -> str:
    """``qmoe_doctor.kernels.specimens.<module>:moe_grouped_gemm`` for specimen ``name``."""
    return get_specimen(name).ref
