"""Resolve a ``--kernel`` reference to a callable ``fn(x, w, m_sizes) -> y`` (child side).

References:

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

KernelFn = Callable[..., Any]


class KernelResolutionError(Exception):
    """The kernel reference cannot be imported or does not have the expected signature."""


def split_ref(ref: str) -> tuple[str, str]:
    """``"a.b:fn"`` -> ``("a.b", "fn")``; the last colon splits (Windows drive letters aside)."""
    if ":" not in ref:
        raise KernelResolutionError(
            f"kernel reference {ref!r} has no ':function' part; use module:function, "
            "path/to/file.py:function, specimen:NAME, torch:grouped_mm or builtin"
        )
    where, _, name = ref.rpartition(":")
    if not where or not name:
        raise KernelResolutionError(f"kernel reference {ref!r} is incomplete")
    return where, name


@functools.cache
def load_kernel(ref: str) -> KernelFn:
    if ref == "builtin":
        from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm

        return moe_grouped_gemm
    if ref == "torch:grouped_mm":
        return torch_grouped_mm
    if ref.startswith("adapter:"):
        from qmoe_doctor.probes.adapters import load_adapted

        return load_adapted(ref)
    where, name = split_ref(ref)
    if where == "specimen":
        from qmoe_doctor.core.specimens import get_specimen, kernel_ref

        try:
            get_specimen(name)
        except KeyError as exc:
            raise KernelResolutionError(str(exc.args[0])) from None
        return load_kernel(kernel_ref(name))
    fn = resolve_object(ref)
    check_signature(fn, ref)
    return fn  # type: ignore[no-any-return]


def resolve_object(ref: str) -> Any:
    """The object ``module:attr`` or ``path/to/file.py:attr`` names, with no signature check
    (an adapter's target may be a class, a module-level op, anything its adapter knows)."""
    where, name = split_ref(ref)
    if where.endswith(".py") or "/" in where:
        module = _load_file(Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:  # any import-time failure of the user's module
            raise KernelResolutionError(
                f"cannot import module {where!r}: {type(exc).__name__}: {exc}"
            ) from exc
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise KernelResolutionError(
            f"{where!r} has no attribute {name!r}; callables there: {', '.join(public[:20]) or 'none'}"
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
    except Exception as exc:
        raise KernelResolutionError(f"importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


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
