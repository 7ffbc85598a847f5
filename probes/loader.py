"""Resolve a kernel reference to a callable ``fn(x, w, m_sizes) -> y`` (child side).

The reference is parsed by the one grammar, ``qmoe_doctor.core.kernel_ref.KernelRef`` (the parent
parsed and checked the same text before this child started); this module imports what it names:

* ``builtin``: our ``moe_grouped_gemm``
* ``specimen:NAME``: a deliberately faulty specimen (``qmoe-doctor specimens`` lists them)
* ``torch:grouped_mm``: an adapter over ``torch._grouped_mm`` (a control that should pass)
* ``module.path:function``: imported with importlib
* ``path/to/file.py:function``: loaded from the file
* ``adapter:NAME[:TARGET]``: TARGET (any object) wrapped by a kernel adapter
  (``qmoe_doctor.probes.adapters``)
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qmoe_doctor.core.kernel_ref import KernelRef, KernelRefError, RefKind

KernelFn = Callable[..., Any]


class KernelResolutionError(Exception):
    """The kernel reference cannot be imported or does not have the expected signature.

    Its qualified name is how the parent classifies the probe's end (``kernel-import``, a usage
    error): ``qmoe_doctor.core.error_kind``."""


def as_ref(ref: str | KernelRef) -> KernelRef:
    """``ref`` parsed (a ProbeSpec carries the canonical text). Raises KernelResolutionError."""
    if isinstance(ref, KernelRef):
        return ref
    try:
        return KernelRef.parse(ref)
    except KernelRefError as exc:
        raise KernelResolutionError(str(exc)) from None


def load_kernel(ref: str | KernelRef) -> KernelFn:
    """The callable ``ref`` names, with its signature checked. Raises KernelResolutionError."""
    return _load(as_ref(ref))


@functools.cache
def _load(ref: KernelRef) -> KernelFn:
    match ref.kind:
        case RefKind.BUILTIN:
            from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm

            return moe_grouped_gemm
        case RefKind.TORCH:
            return torch_grouped_mm
        case RefKind.ADAPTER:
            from qmoe_doctor.probes.adapters import load_adapted

            return load_adapted(ref)
        case RefKind.SPECIMEN:
            routed = _routed_specimen(ref)
            if routed is not None:  # a routed specimen: through its protocol's adapter
                from qmoe_doctor.probes.adapters import load_adapted

                return load_adapted(routed)
            standalone = _specimen_module(ref)
            return _load(standalone)
        case _:
            fn = resolve_object(ref)
            check_signature(fn, str(ref))
            return fn  # type: ignore[no-any-return]


def _routed_specimen(ref: KernelRef) -> KernelRef | None:
    """``adapter:<protocol>:<module>:<function>`` for a specimen of a routed protocol, else None."""
    from qmoe_doctor.core.specimens import get_specimen

    try:
        info = get_specimen(ref.name)
    except KeyError as exc:
        raise KernelResolutionError(str(exc.args[0])) from None
    if info.protocol == "m_sizes":
        return None
    return KernelRef(kind=RefKind.ADAPTER, name=info.protocol, target=KernelRef.parse(info.ref))


def _specimen_module(ref: KernelRef) -> KernelRef:
    from qmoe_doctor.core.specimens import get_specimen

    try:
        get_specimen(ref.name)
    except KeyError as exc:
        raise KernelResolutionError(str(exc.args[0])) from None
    plain = ref.standalone()
    assert plain is not None  # a specimen is always a module:function
    return plain


def resolve_object(ref: str | KernelRef) -> Any:
    """The object a ``module:attr`` or ``path/to/file.py:attr`` reference names, with no
    signature check (an adapter's target may be a class, a module-level op, anything its adapter
    knows). Raises KernelResolutionError."""
    ref = as_ref(ref)
    if ref.kind is RefKind.FILE:
        module = _load_file(ref.path)
    elif ref.kind is RefKind.MODULE:
        try:
            module = importlib.import_module(ref.name)
        except SystemExit as exc:
            raise KernelResolutionError(f"importing module {ref.name!r} {_exited(exc)}") from None
        except Exception as exc:  # any import-time failure of the user's module
            raise KernelResolutionError(
                f"cannot import module {ref.name!r}: {type(exc).__name__}: {exc}"
            ) from exc
    else:
        raise KernelResolutionError(f"{str(ref)!r} names no module:attr or path/to/file.py:attr")
    fn = getattr(module, ref.attr, None)
    if fn is None:
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise KernelResolutionError(
            f"{ref.name!r} has no attribute {ref.attr!r}; callables there: {', '.join(public[:20]) or 'none'}"
        )
    return fn


def _load_file(path: Path) -> Any:
    if not path.is_file():
        raise KernelResolutionError(f"kernel file {str(path)!r} does not exist")
    mod_name = f"qmoe_user_kernel_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise KernelResolutionError(f"cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # triton.jit needs inspect.getsource to find the module
    sys.path.insert(0, str(path.resolve().parent))  # sibling imports of the user's file
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        raise KernelResolutionError(f"importing {str(path)!r} {_exited(exc)}") from None
    except Exception as exc:
        raise KernelResolutionError(f"importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _exited(exc: SystemExit) -> str:
    """``sys.exit(...)`` at import, in words: the status the process would have exited with."""
    code = exc.code
    status = 0 if code is None else code if isinstance(code, int) else 1
    return f"exited {status} at import: it called sys.exit({code!r})"


def check_signature(fn: Any, ref: str) -> None:
    if not callable(fn):
        raise KernelResolutionError(f"{ref!r} is not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins / C extensions: cannot check, let the call tell
    try:
        sig.bind(object(), object(), object())
    except TypeError as exc:
        raise KernelResolutionError(
            f"{ref!r} has signature {sig}; qmoe-doctor calls kernels as fn(x, w, m_sizes) -> y "
            f"(x (M, K) rows sorted by expert, w (E, N, K), m_sizes (E,)): {exc}"
        ) from None


def torch_grouped_mm(x: Any, w: Any, m_sizes: Any, *, out_dtype: Any = None) -> Any:
    """Adapter over ``torch._grouped_mm`` with cumulative offsets: the always-passing control.

    ``torch._grouped_mm`` needs bf16 on sm90+ and 16-byte aligned strides; it does not mask a
    wrong m_sizes, so callers give it valid routing.
    """
    import torch

    with torch.cuda.device(x.device):
        offs = torch.cumsum(m_sizes, 0, dtype=torch.int32)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return y if out_dtype is None else y.to(out_dtype)
