"""Kernel adapters, child side: plug a kernel with another signature into qmoe-doctor.

qmoe-doctor calls every kernel as ``fn(x, w, m_sizes) -> y``: x (M, K) rows sorted by expert,
w (E, N, K), m_sizes (E,) int32 rows per expert, y (M, N). An adapter takes the user's object
(a function of another signature, a class, an op) and returns such a callable, and says what
the kernel can take, so that probes it cannot run are SKIPPED with the reason instead of
failing::

    # mylib/qmoe.py: shipped by the kernel library
    from qmoe_doctor.probes.adapters import SimpleAdapter

    def _wrap(grouped_mm):  # grouped_mm(x, w_t, offs) with w_t (E, K, N), offs cumulative
        def fn(x, w, m_sizes):
            offs = m_sizes.cumsum(0, dtype=torch.int32)
            return grouped_mm(x, w.transpose(1, 2), offs)
        return fn

    ADAPTER = SimpleAdapter(
        wrap=_wrap,
        dtypes=frozenset({"bfloat16"}),  # the probes run bfloat16 on GPUs, float32 on the CPU tier
        needs_contiguous=True,
        supports_cpu=False,  # no CPU / Triton-interpreter path
        default_target="mylib.ops:grouped_mm",
    )

    # mylib's pyproject.toml
    [project.entry-points."qmoe_doctor.adapters"]
    mylib = "mylib.qmoe:ADAPTER"

Then ``qmoe-doctor scan --kernel adapter:mylib`` (its default target) or
``--kernel adapter:mylib:mylib.ops:other_mm``. Without packaging, NAME may be the dotted path
of an adapter object: ``--kernel adapter:my_adapters.ADAPTER:path/to/kernel.py:grouped_mm``.

Conventions common enough to need no code ship here (``qmoe_doctor.core.kernel_ref.BUILTIN_ADAPTERS``
names them; the names are reserved): ``--kernel adapter:flat-weights:mylib/ops.py:grouped_gemm`` for
a kernel ``fn(x, w2d, m_sizes)`` that takes the expert weights flattened to ``(E*N, K)``
(:data:`FLAT_WEIGHTS`).

Entry points are loaded here, in the probe child, never in the parent: loading one imports the
kernel library, and the kernel library imports torch.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from qmoe_doctor.core.conditions import M_SIZES_EDGES, ROUTED_EDGES, ROUTED_ORDER
from qmoe_doctor.core.kernel_ref import (
    BUILTIN_ADAPTERS,
    ENTRY_POINT_GROUP,
    KernelRef,
    KernelRefError,
    RefKind,
)
from qmoe_doctor.core.records import Condition, ProbeSpec
from qmoe_doctor.probes.loader import (
    KernelFn,
    KernelResolutionError,
    as_ref,
    check_signature,
    load_kernel,
    resolve_object,
)

#: Offset-sweep variants whose operands are not contiguous (probes/conditions.OFFSET_VARIANTS).
NON_CONTIGUOUS_VARIANTS = frozenset({"padded-rows", "transposed-w"})

__all__ = [
    "FLAT_WEIGHTS",
    "AdaptedKernel",
    "KernelAdapter",
    "KernelLimits",
    "SimpleAdapter",
    "find_adapter",
    "load_adapted",
    "not_applicable",
    "protocol_mismatch",
]


@runtime_checkable
class KernelAdapter(Protocol):
    """What an adapter is. ``adapt`` is required; an object without the metadata properties
    gets :class:`KernelLimits`' defaults (any dtype, any layout, runs on CPU tensors)."""

    @property
    def dtypes(self) -> frozenset[str] | None:
        """Operand dtypes the kernel takes ("bfloat16", "float16", "float32"); None: all."""
        ...

    @property
    def needs_contiguous(self) -> bool:
        """The kernel requires contiguous x and w: strided-view probes do not apply."""
        ...

    @property
    def supports_cpu(self) -> bool:
        """The kernel runs on CPU tensors (Triton kernels do, under TRITON_INTERPRET=1): the
        CPU tier applies."""
        ...

    @property
    def default_target(self) -> str | None:
        """The kernel reference ``adapter:NAME`` (no target) means; None: a target is required."""
        ...

    def adapt(self, target: Any) -> KernelFn:
        """Turn the user's object into ``fn(x, w, m_sizes) -> y``."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelLimits:
    """What a kernel can take; a probe outside them is skipped with the reason."""

    dtypes: frozenset[str] | None = None
    needs_contiguous: bool = False
    supports_cpu: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class SimpleAdapter:
    """A ready KernelAdapter: ``wrap(target)`` builds the callable, the fields are metadata."""

    wrap: Callable[[Any], KernelFn]
    dtypes: frozenset[str] | None = None
    needs_contiguous: bool = False
    supports_cpu: bool = True
    default_target: str | None = None

    def adapt(self, target: Any) -> KernelFn:
        return self.wrap(target)


class AdaptedKernel:
    """The callable the probes get for an ``adapter:`` reference: the adapted function plus
    the limits it was declared with."""

    def __init__(self, fn: KernelFn, *, ref: str, limits: KernelLimits) -> None:
        self.fn = fn
        self.ref = ref
        self.limits = limits

    def __call__(self, x: Any, w: Any, m_sizes: Any) -> Any:
        return self.fn(x, w, m_sizes)

    def __repr__(self) -> str:
        return f"AdaptedKernel({self.ref!r}, {self.limits})"


#: The operand dtypes an adapter may declare (what the probes run: bfloat16 on GPUs, float32 on
#: the CPU tier, float16 in tests).
KNOWN_DTYPES = frozenset({"bfloat16", "float16", "float32"})


def limits_of(adapter: object, name: str = "the adapter") -> KernelLimits:
    """The adapter's declared limits; missing attributes take the defaults. A declaration that
    is not one (``dtypes = 5``, a property that raises, a dtype no probe runs) raises
    KernelResolutionError: the kernel cannot be used as declared, a usage error (exit 2)."""
    default = KernelLimits()

    def declared(attr: str, fallback: Any) -> Any:
        try:
            return getattr(adapter, attr, fallback)
        except Exception as exc:
            raise KernelResolutionError(
                f"adapter {name!r}: reading its {attr!r} raised {type(exc).__name__}: {exc}"
            ) from exc

    raw_dtypes = declared("dtypes", default.dtypes)
    dtypes: frozenset[str] | None = None
    if raw_dtypes is not None:
        if isinstance(raw_dtypes, (str, bytes)) or not hasattr(raw_dtypes, "__iter__"):
            raise KernelResolutionError(
                f"adapter {name!r}: dtypes must be None or a collection of {', '.join(sorted(KNOWN_DTYPES))}, "
                f"got {raw_dtypes!r:.80}"
            )
        dtypes = frozenset(str(d).removeprefix("torch.") for d in raw_dtypes)
        unknown = sorted(dtypes - KNOWN_DTYPES)
        if unknown or not dtypes:
            raise KernelResolutionError(
                f"adapter {name!r}: dtypes {sorted(dtypes)!r:.120} names no dtype the probes run "
                f"({', '.join(sorted(KNOWN_DTYPES))})"
            )
    flags = {}
    for attr in ("needs_contiguous", "supports_cpu"):
        value = declared(attr, getattr(default, attr))
        if not isinstance(value, bool):
            raise KernelResolutionError(f"adapter {name!r}: {attr} must be True or False, got {value!r:.80}")
        flags[attr] = value
    return KernelLimits(dtypes=dtypes, **flags)


def _as_adapter(obj: Any, name: str) -> Any:
    if inspect.isclass(obj):  # an adapter class: instantiate it with no arguments
        try:
            obj = obj()
        except Exception as exc:
            raise KernelResolutionError(
                f"adapter {name!r}: {obj.__name__}() failed: {type(exc).__name__}: {exc}"
            ) from exc
    if not callable(getattr(obj, "adapt", None)):
        raise KernelResolutionError(
            f"adapter {name!r} is a {type(obj).__name__}, not a KernelAdapter: it has no "
            "adapt(target) method (see qmoe_doctor.probes.adapters)"
        )
    return obj


# --------------------------------------------------------------------------------------------
# The built-in adapters (their names and descriptions: qmoe_doctor.core.kernel_ref.BUILTIN_ADAPTERS)
# --------------------------------------------------------------------------------------------


def flatten_experts(w: Any) -> Any:
    """``w`` (E, N, K) as (E*N, K), expert e's weight in rows e*N .. e*N + N - 1.

    A view of the same storage wherever w's layout has one (a contiguous stack, one a few elements
    into its storage, rows padded in K): the kernel sees the base and strides the probe made, so
    an offset or padded-rows cell tests the kernel, not this adapter. A w with no such view (a
    transposed w: K is not its contiguous dimension) is copied into the same kind of layout, a
    column-major (E*N, K) (strides (1, E*N)), so a strided-w cell still hands the kernel a strided
    w."""
    e, n, k = w.shape
    try:
        return w.view(e * n, k)
    except RuntimeError:  # torch: "view size is not compatible with input tensor's size and stride"
        pass
    if w.stride(2) == 1:  # rows contiguous, E and N not mergeable: a row-major copy
        return w.reshape(e * n, k)
    return w.permute(2, 0, 1).reshape(k, e * n).t()


def _flat_weights(target: Any) -> KernelFn:
    if not callable(target):
        raise TypeError(f"the target is a {type(target).__name__}, not a function fn(x, w2d, m_sizes)")

    def fn(x: Any, w: Any, m_sizes: Any) -> Any:
        return target(x, flatten_experts(w), m_sizes)

    fn.__name__ = getattr(target, "__name__", "flat_weights_kernel")
    fn.__qualname__ = f"flat_weights({fn.__name__})"
    return fn


#: ``adapter:flat-weights:TARGET``: TARGET is ``fn(x, w2d, m_sizes) -> y`` with the expert weights
#: flattened to (E*N, K) (N = w2d.shape[0] // len(m_sizes)). Any dtype, any layout, CPU tensors
#: too: what the kernel itself cannot take shows in the cells, as for a kernel of our signature.
FLAT_WEIGHTS = SimpleAdapter(wrap=_flat_weights)


def _builtin_adapter(name: str) -> Any:
    """The object of one of our adapters (``BUILTIN_ADAPTERS[name].obj``, ``module:attr``)."""
    module_name, _, attr = BUILTIN_ADAPTERS[name].obj.partition(":")
    return _as_adapter(getattr(importlib.import_module(module_name), attr), name)


def find_adapter(name: str) -> Any:
    """The adapter called ``name``: one of ours (reserved names), else an entry point of the
    group ``qmoe_doctor.adapters``, else the object a dotted ``module.attr`` path names. Raises
    KernelResolutionError."""
    if name in BUILTIN_ADAPTERS:
        return _builtin_adapter(name)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name != name:
            continue
        try:
            obj = ep.load()
        except Exception as exc:  # any import-time failure of the adapter's package
            raise KernelResolutionError(
                f"adapter {name!r} (entry point {ep.value!r}) could not be loaded: {type(exc).__name__}: {exc}"
            ) from exc
        return _as_adapter(obj, name)
    module_name, dot, attr = name.rpartition(".")
    if not dot or not module_name:
        installed = sorted(ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        raise KernelResolutionError(
            f"no adapter named {name!r}: not one of ours ({', '.join(BUILTIN_ADAPTERS)}) nor in the "
            f"entry-point group {ENTRY_POINT_GROUP!r} (installed: {', '.join(installed) or 'none'}); "
            "or give module.attr of an adapter object"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise KernelResolutionError(
            f"adapter {name!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    if not hasattr(module, attr):
        raise KernelResolutionError(f"adapter {name!r}: module {module_name!r} has no attribute {attr!r}")
    return _as_adapter(getattr(module, attr), name)


def load_adapted(ref: str | KernelRef) -> AdaptedKernel:
    """Resolve ``adapter:NAME[:TARGET]`` to the adapted kernel. Raises KernelResolutionError
    (the probe's outcome is then ``kernel-import``, a usage error for scan and check)."""
    parsed = as_ref(ref)
    if parsed.kind is not RefKind.ADAPTER:
        raise KernelResolutionError(f"{str(parsed)!r} is not an adapter reference (adapter:NAME[:TARGET])")
    adapter = find_adapter(parsed.name)
    target_ref = parsed.target or _default_target(parsed, adapter)
    if target_ref.kind in (RefKind.BUILTIN, RefKind.TORCH, RefKind.SPECIMEN):
        target = load_kernel(target_ref)
    else:
        target = resolve_object(target_ref)
    try:
        fn = adapter.adapt(target)
    except Exception as exc:
        raise KernelResolutionError(
            f"adapter {parsed.name!r} could not adapt {str(target_ref)!r}: {type(exc).__name__}: {exc}"
        ) from exc
    check_signature(fn, f"{parsed} (as adapted)")
    limits = limits_of(adapter, str(parsed))
    if isinstance(fn, AdaptedKernel):  # an adapter that builds its own (the routed ones)
        fn.ref, fn.limits = str(parsed), limits
        return fn
    return AdaptedKernel(fn, ref=str(parsed), limits=limits)


def _default_target(ref: KernelRef, adapter: object) -> KernelRef:
    """The kernel ``adapter:NAME`` means: the adapter's ``default_target``, in the same grammar."""
    default = getattr(adapter, "default_target", None)
    if not default:
        raise KernelResolutionError(
            f"{str(ref)!r}: adapter {ref.name!r} has no default_target; name the kernel: "
            f"adapter:{ref.name}:module:function"
        )
    try:
        target = KernelRef.parse(str(default))
    except KernelRefError as exc:
        raise KernelResolutionError(f"adapter {ref.name!r}: its default_target: {exc}") from None
    if target.kind is RefKind.ADAPTER:
        raise KernelResolutionError(f"adapter {ref.name!r}: its default_target {default!r} is another adapter")
    return target


def protocol_mismatch(kernel: object, spec: ProbeSpec) -> str | None:
    """Why a cell of one protocol does not apply to a kernel of the other (the scan plans each
    kernel's own; ``--only`` may still name the others), or None."""
    protocol = getattr(kernel, "protocol", "m_sizes")
    if protocol != "m_sizes" and spec.condition in M_SIZES_EDGES:
        return (
            f"a routed kernel ({protocol}) takes no m_sizes: its routing edges are the routed cells "
            f"({', '.join(c.value for c in ROUTED_EDGES)})"
        )
    if protocol == "m_sizes" and spec.condition in ROUTED_ORDER:
        return (
            "the routed cells call fn(hidden_states, w, topk_ids, topk_weights[, expert_map]): this kernel "
            "takes m_sizes (name a routed kernel as adapter:routed:TARGET or adapter:routed-rows:TARGET)"
        )
    return None


def not_applicable(kernel: object, spec: ProbeSpec) -> str | None:
    """Why this probe does not apply to the kernel (its adapter's declared limits, its
    protocol), or None. Plain kernels declare nothing: every probe of their protocol applies."""
    mismatch = protocol_mismatch(kernel, spec)
    if mismatch is not None:
        return mismatch
    if not isinstance(kernel, AdaptedKernel):
        return None
    limits = kernel.limits
    if spec.device is None and not limits.supports_cpu:
        return (
            "the kernel's adapter declares no CPU support (supports_cpu=False): the CPU tier does not apply"
        )
    if limits.dtypes is not None and spec.shape.dtype not in limits.dtypes:
        return (
            f"the kernel's adapter takes {', '.join(sorted(limits.dtypes))} only; "
            f"this probe runs {spec.shape.dtype}"
        )
    if (
        limits.needs_contiguous
        and spec.condition is Condition.OFFSETS
        and spec.params.get("variant") in NON_CONTIGUOUS_VARIANTS
    ):
        return (
            f"the kernel's adapter requires contiguous inputs (needs_contiguous=True); the "
            f"{spec.params['variant']} variant passes strided views"
        )
    return None
