"""The vocabulary of the device rules, within one file: what is a device guard, and where a
device or a stream comes from.

A *guard* is a ``with`` whose call ends in ``device``, ``device_of``, ``device_guard``,
``cuda_guard``, ``DeviceGuard`` or ``device_index``, or ``torch.cuda.stream(s)`` of a stream
with an explicit device (entering it makes that device current). ``torch.device(...)`` is not
one: it sets the default device of tensor factories, not the CUDA device. A device is
*undeviced* when it is not taken from a tensor: ``"cuda"``, ``0``, ``current_device()``.

Whether a guard is held through the callers of a function is a project question
(:meth:`qmoe_doctor.lint.project.Project.guarded`).
"""

from __future__ import annotations

import ast
import re
from typing import Literal

from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FUNC_TYPES, arg, is_none, last, param_names, src

_GUARD_SUFFIXES = ("device", "device_of", "device_guard", "cuda_guard", "deviceguard", "device_index")
STREAM_CONTEXTS = frozenset(
    {"torch.cuda.stream", "torch.cuda.StreamContext", "torch.cuda.streams.StreamContext"}
)
_STREAM_MAKERS = frozenset(
    {
        "torch.cuda.current_stream",
        "torch.cuda.default_stream",
        "torch.cuda.Stream",
        "torch.cuda.streams.Stream",
    }
)
_CUDA_STRING = re.compile(r"^cuda(:\d+)?$")

StreamDevice = Literal["none", "literal", "explicit"]


def undeviced(m: Module, expr: ast.expr | None, *, depth: int = 0) -> str | None:
    """Describe a device expression that is not taken from a tensor (``"cuda"``, ``0``,
    ``torch.cuda.current_device()``, ``torch.device("cuda")``, a module constant of those);
    None for anything else (``x.device``, a parameter, ``"cpu"``)."""
    if expr is None:
        return None
    if isinstance(expr, ast.Constant):
        v = expr.value
        if isinstance(v, bool):
            return None
        if isinstance(v, int):
            return f"device {v} (hard-coded)"
        if isinstance(v, str) and _CUDA_STRING.match(v):
            return f"{v!r} (the current device)" if v == "cuda" else f"{v!r} (a hard-coded device)"
        return None
    if isinstance(expr, ast.Call):
        name = m.canon(expr.func) or ""
        if last(name) in ("current_device", "get_active_torch_device"):
            return f"{src(expr)} (the current device)"
        if name == "torch.device" and expr.args:
            inner = undeviced(m, expr.args[0], depth=depth + 1)
            if inner is not None:
                index = len(expr.args) > 1 or "current device" not in inner
                return f"{src(expr)} ({'a hard-coded' if index else 'the current'} device)"
        return None
    if isinstance(expr, ast.Attribute) and expr.attr == "type":
        if isinstance(expr.value, ast.Attribute) and expr.value.attr == "device":
            return f"{src(expr)} ('cuda' with no index)"
    if isinstance(expr, ast.Name) and depth < 2:
        func = m.func_of(expr)
        if func is not None and expr.id in param_names(func):
            return None  # handed in by the caller
        value = m.local_value(expr)
        if value is not None and undeviced(m, value, depth=depth + 1) is not None:
            return f"{expr.id} = {src(value)}"
    return None


def stream_device(m: Module, expr: ast.expr, depth: int = 0) -> StreamDevice:
    """Where a stream expression's device comes from: none (the current device), a literal
    device, or an explicit expression (a tensor's device, a stream handed in)."""
    if isinstance(expr, ast.Name) and depth < 3:
        value = m.local_value(expr)
        return stream_device(m, value, depth + 1) if value is not None else "explicit"
    if not isinstance(expr, ast.Call):
        return "explicit"
    if (m.canon(expr.func) or "") not in _STREAM_MAKERS:
        return "explicit"
    device = arg(expr, 0, "device")
    if device is None or is_none(device):
        return "none"
    desc = undeviced(m, device)
    if desc is None:
        return "explicit"
    return "none" if "current device" in desc else "literal"


def is_guard_cm(m: Module, expr: ast.expr, depth: int = 0) -> bool:
    """``expr`` (a ``with`` item) makes a device current. A guard taken only for CUDA tensors
    (``torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()``) is one, and so
    is a local bound to a guard before the ``with``."""
    if isinstance(expr, ast.IfExp):
        branches = (expr.body, expr.orelse)
        return any(is_guard_cm(m, b, depth) for b in branches) and all(
            is_guard_cm(m, b, depth) or _null_context(m, b) for b in branches
        )
    if isinstance(expr, ast.Name) and depth < 2:
        value = m.local_value(expr)
        return value is not None and is_guard_cm(m, value, depth + 1)
    if not isinstance(expr, ast.Call):
        return False
    name = m.canon(expr.func) or ""
    if name == "torch.device":  # sets the default device of factories, not the CUDA device
        return False
    if last(name).lower().lstrip("_").endswith(_GUARD_SUFFIXES):
        return True
    if name in STREAM_CONTEXTS:  # entering a stream makes its device current
        stream = arg(expr, 0, "stream")
        return stream is not None and stream_device(m, stream) == "explicit"
    return False


def _null_context(m: Module, expr: ast.expr) -> bool:
    """``contextlib.nullcontext()`` / ``nullcontext()``: the no-op branch of a conditional guard."""
    return isinstance(expr, ast.Call) and last(m.canon(expr.func) or "") == "nullcontext"


def lexical_guard(m: Module, node: ast.AST) -> bool:
    """``node`` is in the body of a guarding ``with`` of its own function."""
    child = node
    for anc in m.ancestors(node):
        if isinstance(anc, (*FUNC_TYPES, ast.ClassDef)):
            return False
        if isinstance(anc, (ast.With, ast.AsyncWith)) and any(child is s for s in anc.body):
            if any(is_guard_cm(m, item.context_expr) for item in anc.items):
                return True
        child = anc
    return False


def in_torch_device_cm(m: Module, node: ast.AST) -> bool:
    """``node`` is inside ``with torch.device(...)`` (named in messages: it is not a guard)."""
    for anc in m.ancestors(node):
        if isinstance(anc, FUNC_TYPES):
            return False
        if isinstance(anc, (ast.With, ast.AsyncWith)) and any(
            isinstance(i.context_expr, ast.Call) and m.canon(i.context_expr.func) == "torch.device"
            for i in anc.items
        ):
            return True
    return False


__all__ = [
    "STREAM_CONTEXTS",
    "StreamDevice",
    "in_torch_device_cm",
    "is_guard_cm",
    "lexical_guard",
    "stream_device",
    "undeviced",
]
