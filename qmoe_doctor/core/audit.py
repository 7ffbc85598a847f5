"""Shape audit: which operand offsets of a fused MoE pass 2**31 - 1 elements (pure arithmetic).

A fused MoE forms element offsets as ``index * stride`` (``expert_idx * stride_we``,
``row * stride_xm``). Formed in int32, such a product wraps once it passes 2**31 - 1 and the
pointer usually lands inside the same allocation: silently wrong results (cause
``int32-offset-overflow``). This module computes, for one model shape and token count, the
largest element offset each operand reaches and where it first wraps. No torch, no GPU.

Definitions used throughout (element offsets, contiguous layouts):

* ``max_offset``: offset of the operand's last element, ``numel - 1``. An operand *wraps* when
  ``max_offset > 2**31 - 1``.
* ``first_wrap_index``: the smallest index (expert or row) whose *base* offset
  ``index * stride`` passes 2**31 - 1, i.e. the smallest ``i`` with ``i * stride > 2**31 - 1``.
  This is the index the int32 product ``expert_idx * stride_we`` first wraps at, and the one the
  int32 boundary probe routes rows to. 160 experts of a fused gate_up 5120 x 6144 wrap at
  expert 69 (69 * 5120 * 6144 = 2,170,552,320); experts of 2560 x 6144 at expert 137.
* ``straddle_index``: the index holding element offset 2**31 itself. Its base fits but its tail
  does not (expert 68 for 5120 x 6144), so a kernel that also forms ``n * stride_wn + k`` in
  int32 already goes wrong there.

Kernels that take the router's ids (the routed protocol) index rows by *gathered* ids loaded from
memory: the flat slot id ``slot = t * top_k + j`` (up to T*k, int32 in ``sorted_token_ids`` /
``gather_indx``) times the row stride of a slot's row (``slot * stride_om``: the (T*k, N) rows of
each GEMM), and its token ``slot // top_k`` times the row stride of ``hidden_states``. The audit's
``gathered`` rows give where each wraps (``slot 8388608``): the slot rows at the same token count
as the sorted activations of the same width, the token rows ``top_k`` times later.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.inputs import InputError, os_problem, read_bytes, shown_path
from qmoe_doctor.core.records import SCHEMA_VERSION
from qmoe_doctor.core.shapes import MoEShape

#: The largest element offset an int32 index product can hold.
INT32_MAX = 2**31 - 1

#: Default token count of ``qmoe-doctor audit`` (a long prefill or one training micro-batch).
DEFAULT_TOKENS = 16384

#: The fix, one sentence; the docs page has the snippet.
FIX = (
    "Cast the index to int64 where the product is formed (e.g. "
    "expert_idx.to(tl.int64) * stride_we, first_row.to(tl.int64) * stride_xm), not every stride."
)

DOCS_PAGE = "docs/causes/int32-offset-overflow.md"


class OperandKind(StrEnum):
    EXPERT_STACK = "expert-stack"  # (E, N, K) indexed by expert_idx * stride_we
    ACTIVATION = "activation"  # (rows, cols) indexed by row * stride_m; rows = tokens * top_k
    # (rows, cols) indexed by a gathered id loaded from memory: a slot id (t * top_k + j) times a
    # slot row's stride, or its token (slot // top_k) times hidden_states' row stride
    GATHERED = "gathered-id"


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditRow:
    """One operand of the fused MoE and how far its element offsets reach."""

    operand: str  # "gate_up.w", "down.x", ...
    role: str  # what the operand is, in words
    kind: OperandKind
    shape: tuple[int, ...]  # (E, N, K) or (rows, cols)
    index_stride: int  # elements per expert (N * K) or per row (cols): the stride the index multiplies
    max_offset: int  # offset of the last element (numel - 1)
    limit: int = INT32_MAX
    wraps: bool  # max_offset > limit
    first_wrap: str | None = None  # "expert 69", "row 1048576", or "row 9 (tail only)"; None if it fits
    first_wrap_index: int | None = None  # smallest index with index * index_stride > limit, if < count
    straddle_index: int | None = None  # index holding element offset limit + 1 (None if it fits)
    wrap_tokens: int | None = None  # activations: smallest token count at which this operand wraps


@dataclass(frozen=True, slots=True, kw_only=True)
class AuditReport:
    """The audit of one model shape at one token count."""

    schema_version: int = SCHEMA_VERSION
    shape_name: str
    source: str  # "preset" or the config file path
    shape: MoEShape
    tokens: int
    sorted_rows: int  # tokens * top_k: rows of the expert-sorted activations
    limit: int = INT32_MAX
    rows: tuple[AuditRow, ...]
    min_wrap_tokens: int  # smallest token count at which any activation operand wraps
    min_wrap_operands: tuple[str, ...]  # the activation operands that wrap at min_wrap_tokens
    # the routed protocol's gathered ids (slot ids up to T*k, their tokens); top_k as audited
    top_k: int = 0  # 0 in reports written before the field: the shape's own
    gathered: tuple[AuditRow, ...] = ()
    gathered_min_wrap_tokens: int | None = None  # smallest token count at which a gathered product wraps
    gathered_min_wrap_operands: tuple[str, ...] = ()

    @property
    def wrapping(self) -> tuple[AuditRow, ...]:
        return tuple(r for r in self.rows if r.wraps)

    @property
    def wraps(self) -> bool:
        return any(r.wraps for r in self.rows)

    def row(self, operand: str) -> AuditRow:
        for r in self.rows:
            if r.operand == operand:
                return r
        raise KeyError(f"no operand {operand!r} in the audit of {self.shape_name}")


class ConfigError(ValueError):
    """A model config file that cannot be read as a MoE shape. The message names the file."""


# --------------------------------------------------------------------------- arithmetic


def first_wrapping_index(stride: int, *, limit: int = INT32_MAX) -> int:
    """Smallest ``i`` with ``i * stride > limit``: the first index whose base offset wraps."""
    if stride <= 0:
        raise ValueError(f"stride must be positive, got {stride}")
    return limit // stride + 1


def first_wrapping_expert(
    n: int, k: int, *, num_experts: int | None = None, limit: int = INT32_MAX
) -> int | None:
    """First expert of an (E, n, k) contiguous stack whose base offset ``e * n * k`` passes
    ``limit`` (2**31 - 1): the smallest ``e`` with ``e * n * k > limit``.

    ``first_wrapping_expert(5120, 6144) == 69`` and ``first_wrapping_expert(6144, 2560) == 137``.
    With ``num_experts`` given, returns None when that expert does not exist (the stack fits
    its base offsets). Always >= 1: expert 0's base offset is 0.
    """
    if n <= 0 or k <= 0:
        raise ValueError(f"n and k must be positive, got n={n}, k={k}")
    e = first_wrapping_index(n * k, limit=limit)
    if num_experts is not None and e >= num_experts:
        return None
    return e


def min_wrap_tokens(top_k: int, cols: int, *, limit: int = INT32_MAX) -> int:
    """Smallest token count T at which a (T * top_k, cols) activation passes ``limit``:
    the smallest T with ``T * top_k * cols - 1 > limit``."""
    if top_k <= 0 or cols <= 0:
        raise ValueError(f"top_k and cols must be positive, got top_k={top_k}, cols={cols}")
    return (limit + 1) // (top_k * cols) + 1


def _audit_operand(
    *,
    operand: str,
    role: str,
    kind: OperandKind,
    count: int,  # experts or rows
    inner: tuple[int, ...],  # (N, K) or (cols,)
    limit: int,
    top_k: int,  # rows per token of the operand (1: one row per token)
    unit: str | None = None,  # how its index is named ("slot", "token"); default expert / row
) -> AuditRow:
    stride = 1
    for d in inner:
        stride *= d
    max_offset = count * stride - 1
    wraps = max_offset > limit
    unit = unit or ("expert" if kind is OperandKind.EXPERT_STACK else "row")
    first = first_wrapping_index(stride, limit=limit)
    first_index = first if first < count else None
    straddle = (limit + 1) // stride if wraps else None
    if not wraps:
        text = None
    elif first_index is not None:
        text = f"{unit} {first_index}"
    else:  # only the last unit's tail passes the limit; no base offset does
        text = f"{unit} {straddle} (tail only)"
    return AuditRow(
        operand=operand,
        role=role,
        kind=kind,
        shape=(count, *inner),
        index_stride=stride,
        max_offset=max_offset,
        limit=limit,
        wraps=wraps,
        first_wrap=text,
        first_wrap_index=first_index,
        straddle_index=straddle,
        wrap_tokens=min_wrap_tokens(top_k, stride, limit=limit)
        if kind is not OperandKind.EXPERT_STACK
        else None,
    )


def gathered_rows(shape: MoEShape, tokens: int, *, limit: int = INT32_MAX) -> tuple[AuditRow, ...]:
    """The products of gathered ids with row strides in a routed kernel at ``tokens`` tokens:
    slot ids (up to tokens * top_k) times the row stride of each GEMM's slot rows, and their
    tokens (slot // top_k) times hidden_states' row stride."""
    top_k = shape.top_k
    gu_n, _ = shape.gate_up_nk
    dn_n, dn_k = shape.down_nk
    rows = tokens * top_k
    g = OperandKind.GATHERED
    specs: tuple[tuple[str, str, int, int, int, str], ...] = (
        (
            "gathered.hidden",
            "hidden_states read at (slot // top_k) * stride: the gather",
            tokens,
            shape.hidden,
            1,
            "token",
        ),
        (
            "gathered.gate_up.y",
            "each slot's gate_up row at slot * stride (routed-rows out)",
            rows,
            gu_n,
            top_k,
            "slot",
        ),
        ("gathered.down.x", "each slot's down input row at slot * stride", rows, dn_k, top_k, "slot"),
        (
            "gathered.down.y",
            "each slot's down row at slot * stride, before the weighted sum",
            rows,
            dn_n,
            top_k,
            "slot",
        ),
    )
    return tuple(
        _audit_operand(
            operand=name,
            role=role,
            kind=g,
            count=count,
            inner=(cols,),
            limit=limit,
            top_k=per_token,
            unit=unit,
        )
        for name, role, count, cols, per_token, unit in specs
    )


def audit_shape(
    shape: MoEShape,
    tokens: int,
    *,
    source: str = "preset",
    limit: int = INT32_MAX,
    top_k: int | None = None,
) -> AuditReport:
    """Largest element offset of every operand of the fused MoE forward and backward at
    ``tokens`` tokens (``tokens * top_k`` expert-sorted rows), against ``limit``.

    Operands: gate_up (N = 2 * intermediate, K = hidden) and down (N = hidden,
    K = intermediate) weight stacks and their dW stacks, and the sorted activations x and y of
    both GEMMs (gate_up.y is the intermediate activation, rows x 2 * intermediate). Backward
    dx / dy have the shapes of x / y and are covered by those rows. ``gathered``: the same call
    in a kernel that takes the router's ids (``gathered_rows``). ``top_k`` overrides the shape's
    experts per token (a router configured otherwise than the model's config).
    """
    if tokens <= 0:
        raise ValueError(f"tokens must be positive, got {tokens}")
    if top_k is not None:
        if top_k <= 0 or top_k > shape.num_experts:
            raise ValueError(f"top_k must be in [1, {shape.num_experts}] (the expert count), got {top_k}")
        shape = replace(shape, top_k=top_k)
    e, top_k = shape.num_experts, shape.top_k
    gu_n, gu_k = shape.gate_up_nk
    dn_n, dn_k = shape.down_nk
    rows = tokens * top_k
    stack = OperandKind.EXPERT_STACK
    act = OperandKind.ACTIVATION
    specs: tuple[tuple[str, str, OperandKind, int, tuple[int, ...]], ...] = (
        ("gate_up.x", "sorted token activations, input of gate_up (and its dx)", act, rows, (gu_k,)),
        ("gate_up.w", "fused gate_up weight stack", stack, e, (gu_n, gu_k)),
        ("gate_up.dw", "gate_up weight gradient (backward)", stack, e, (gu_n, gu_k)),
        ("gate_up.y", "intermediate activation h = [gate | up] (and its dy)", act, rows, (gu_n,)),
        ("down.x", "SiLU(gate) * up, input of down (and its dx)", act, rows, (dn_k,)),
        ("down.w", "down weight stack", stack, e, (dn_n, dn_k)),
        ("down.dw", "down weight gradient (backward)", stack, e, (dn_n, dn_k)),
        ("down.y", "down output per routed row, before the top-k sum (and its dy)", act, rows, (dn_n,)),
    )
    audit_rows = tuple(
        _audit_operand(operand=name, role=role, kind=kind, count=count, inner=inner, limit=limit, top_k=top_k)
        for name, role, kind, count, inner in specs
    )
    # the widest activations wrap first as tokens grow
    wrap_tokens = min(r.wrap_tokens for r in audit_rows if r.wrap_tokens is not None)
    wrap_operands = tuple(r.operand for r in audit_rows if r.wrap_tokens == wrap_tokens)
    gathered = gathered_rows(shape, tokens, limit=limit)
    gathered_tokens = min(r.wrap_tokens for r in gathered if r.wrap_tokens is not None)
    return AuditReport(
        shape_name=shape.name,
        source=source,
        shape=shape,
        tokens=tokens,
        sorted_rows=rows,
        limit=limit,
        rows=audit_rows,
        min_wrap_tokens=wrap_tokens,
        min_wrap_operands=wrap_operands,
        top_k=top_k,
        gathered=gathered,
        gathered_min_wrap_tokens=gathered_tokens,
        gathered_min_wrap_operands=tuple(r.operand for r in gathered if r.wrap_tokens == gathered_tokens),
    )


# --------------------------------------------------------------------------- HF configs

#: Larger than any expert count or width (2**31 elements of offset is the audit's own subject);
#: a value past it is a corrupt config, and printing it would pass Python's int-to-str limit.
MAX_CONFIG_INT = 2**40

#: The config keys a MoE shape is read from; the first name of each tuple is the canonical
#: Qwen3-MoE key, the others are accepted aliases (DeepSeek, Mixtral spell the expert count so).
_INT_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("num_experts", ("num_experts", "n_routed_experts", "num_local_experts")),
    ("num_experts_per_tok", ("num_experts_per_tok",)),
    ("hidden_size", ("hidden_size",)),
    ("moe_intermediate_size", ("moe_intermediate_size",)),
)
#: Architectures whose experts are ``intermediate_size`` wide: they have no separate MoE width
#: (Mixtral, OLMoE, PhiMoE, GraniteMoE, as their Transformers configs define it). Qwen2/3-MoE and
#: DeepSeek configs carry both keys, ``intermediate_size`` being their dense layers' width, so it
#: is read as the experts' width only for these.
EXPERT_WIDTH_IS_INTERMEDIATE = frozenset(
    {"MixtralForCausalLM", "OlmoeForCausalLM", "PhimoeForCausalLM", "GraniteMoeForCausalLM"}
)
#: What a config must be, said when a key is missing.
SUPPORTED = (
    "Qwen2-MoE / Qwen3-MoE and DeepSeek configs (moe_intermediate_size), and "
    + ", ".join(sorted(EXPERT_WIDTH_IS_INTERMEDIATE))
    + " (intermediate_size)"
)


#: How a config value is quoted in a message: a few levels, a few items, short strings. A value
#: from the file may be a 60 MB string or an object nested thousands deep (repr would recurse).
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxdict, _QUOTE.maxlist = 2, 4, 4
_QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlong = 60, 60, 40


def _read_int(cfg: Mapping[str, Any], key: str, aliases: tuple[str, ...], where: str, path: Path) -> int:
    present = [a for a in aliases if a in cfg]
    if not present:
        also = f" (also accepted: {', '.join(repr(a) for a in aliases[1:])})" if len(aliases) > 1 else ""
        raise ConfigError(
            f"{shown_path(path)}: missing key {where + key!r}{also}. A Mixture-of-Experts config needs "
            f"num_experts, num_experts_per_tok, hidden_size and the experts' width; read: {SUPPORTED}."
        )
    name = present[0]
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(
            f"{path}: {where + name!r} must be a positive integer, got {_QUOTE.repr(value)} ({type(value).__name__})."
        )
    if value <= 0:
        raise ConfigError(f"{path}: {where + name!r} must be a positive integer, got {value}.")
    if value > MAX_CONFIG_INT:
        raise ConfigError(
            f"{path}: {where + name!r} is {len(str(value))} digits long; no model dimension is that large."
        )
    return value


def load_hf_config(path: str | Path) -> MoEShape:
    """Read a Hugging Face model ``config.json`` as a MoE shape.

    Reads ``num_experts``, ``num_experts_per_tok``, ``hidden_size``, ``moe_intermediate_size``
    and optionally ``norm_topk_prob``, from ``text_config`` when the config nests the language
    model there (multimodal MoE configs). Raises ConfigError naming the file and the key for a
    missing file, malformed JSON (with line and column), a missing key, or a value that is not
    a positive integer.
    """
    p = Path(path)
    try:
        if p.is_dir():
            raise ConfigError(f"{shown_path(p)}: is a directory; pass the config.json inside it.")
    except OSError as exc:  # a name too long, a symbolic link loop
        raise ConfigError(f"{shown_path(p)}: cannot read ({os_problem(exc)}).") from None
    try:
        # bounded, special files (/dev/zero, a FIFO) refused before a byte is read
        raw = read_bytes(p)  # the one bounded reader: 64 MiB, a gzip's content too
    except InputError as exc:
        raise ConfigError(f"{exc}.") from None
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors save JSON, is no error
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: cannot be read: not UTF-8 text (byte {exc.start}).") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{p}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}."
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{p}: JSON nested too deep to read (a model config is a few levels deep)."
        ) from None
    except ValueError as exc:  # an integer of thousands of digits (int_max_str_digits)
        raise ConfigError(f"{p}: a value is out of range: {exc}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object (a model config), got {type(data).__name__}.")

    cfg: Mapping[str, Any] = data
    where = ""
    nested = data.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise ConfigError(f"{p}: 'text_config' must be an object, got {type(nested).__name__}.")
    if isinstance(nested, dict) and any(a in nested for _, aliases in _INT_KEYS for a in aliases):
        cfg, where = nested, "text_config."

    archs = data.get("architectures")
    keys = _INT_KEYS
    if isinstance(archs, list) and EXPERT_WIDTH_IS_INTERMEDIATE.intersection(
        a for a in archs if isinstance(a, str)
    ):
        keys = (*_INT_KEYS[:3], ("moe_intermediate_size", ("moe_intermediate_size", "intermediate_size")))
    num_experts, top_k, hidden, intermediate = (
        _read_int(cfg, key, aliases, where, p) for key, aliases in keys
    )
    if top_k > num_experts:
        raise ConfigError(
            f"{p}: {where + 'num_experts_per_tok'!r} ({top_k}) is larger than the expert count ({num_experts})."
        )
    norm = cfg.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        raise ConfigError(
            f"{p}: {where + 'norm_topk_prob'!r} must be true or false, got {_QUOTE.repr(norm)}."
        )

    name = data.get("_name_or_path")
    if not isinstance(name, str) or not name:
        name = str(p)
    return MoEShape(
        name=name,
        num_experts=num_experts,
        top_k=top_k,
        hidden=hidden,
        intermediate=intermediate,
        norm_topk_prob=norm,
    )
