"""``default-device-alloc``: ``device="cuda"`` (or ``.cuda()``, ``.to("cuda")``,
``new_empty(device=0)``) outside a guard in a kernel wrapper: the buffer lands on the current
device, not on its inputs' device. A *kernel wrapper* launches a Triton kernel or takes tensor
arguments; under a guard, ``"cuda"`` is the guarded device and stays silent.

The scratch allocator given to ``triton.set_allocator`` (the global scratch of device-side TMA
descriptors, ``tl.make_tensor_descriptor``) is its own case: Triton calls it inside each launch
that needs scratch, so ``"cuda"`` there is the device current *at the launch*. It is reported
when a launch of a kernel that may need scratch (one that makes a descriptor, or one the lint
cannot see) is outside a guard: that launch's scratch, like the launch, lands on the current
device while its tensors live elsewhere. Every such launch guarded, it is silent; a hard-coded
device (``"cuda:0"``, ``0``) is reported always, as no guard moves it.
"""

from __future__ import annotations

import ast

from qmoe_doctor.lint.devices import undeviced
from qmoe_doctor.lint.findings import Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FUNC_TYPES, FuncDef, arg, dotted, kwarg, last, src, text
from qmoe_doctor.lint.project import LaunchSite, Project

# torch.<factory>(..., device=...)
FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "arange",
        "tensor",
        "as_tensor",
        "rand",
        "randn",
        "randint",
        "randperm",
        "empty_strided",
        "linspace",
        "logspace",
        "eye",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
    }
)
NEW_METHODS = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"})


_DESCRIPTOR_MAKERS = frozenset({"make_tensor_descriptor", "_experimental_make_tensor_descriptor"})


def check(project: Project, m: Module) -> None:
    wrappers: dict[ast.AST, bool] = {}
    allocators = _allocators(m)
    for fn, set_call in allocators.items():
        if not m.exempt(set_call):  # a demo's or a test's allocator serves its own launches
            _check_allocator(project, m, fn, set_call)
    for node in m.calls:
        func = m.func_of(node)
        if func is None or m.exempt(node) or any(a is fn for a in m.ancestors(node) for fn in allocators):
            continue
        desc = _default_device_of(m, node)
        if desc is None:
            continue
        if func not in wrappers:
            wrappers[func] = _is_wrapper(project, m, func)
        if not wrappers[func] or project.guarded(m, node):
            continue  # under a guard, "cuda" is the guarded device
        tensor = _tensor_param(func)
        project.add(
            m,
            node,
            Rule.DEFAULT_DEVICE_ALLOC,
            f"`{src(node)}` allocates on {desc} inside the kernel wrapper `{func.name}`: "
            "outside a device guard the buffer lands on the current device, not on its inputs' device",
            f"device={tensor}.device  # allocate where the inputs live",
        )


def _allocators(m: Module) -> dict[ast.AST, ast.Call]:
    """The functions (and lambdas) of ``m`` given to ``triton.set_allocator``, each with its call."""
    out: dict[ast.AST, ast.Call] = {}
    for call in m.calls:
        name = m.canon(call.func) or ""
        if not (name.startswith("triton.") and last(name) == "set_allocator"):
            continue
        given = arg(call, 0, "allocator")
        fn: ast.AST | None = given
        if isinstance(given, ast.Name):  # a def beside the call or at the top, or a name bound to a lambda
            scope: ast.AST = m.func_of(call) or m.tree
            defs = [n for n in m.shallow(scope) if isinstance(n, FUNC_TYPES) and n.name == given.id]
            defs += [n for n in m.tree.body if isinstance(n, FUNC_TYPES) and n.name == given.id]
            fn = defs[0] if defs else next((v for v in m.bindings(given) if isinstance(v, ast.Lambda)), None)
        if isinstance(fn, (*FUNC_TYPES, ast.Lambda)):
            out.setdefault(fn, call)
    return out


def _check_allocator(project: Project, m: Module, fn: ast.AST, set_call: ast.Call) -> None:
    for node in ast.walk(fn):
        if not isinstance(node, ast.Call):
            continue
        desc = _default_device_of(m, node)
        if desc is None:
            continue
        named = f"`{fn.name}`" if isinstance(fn, FUNC_TYPES) else "the allocator"
        where = f"{m.path}:{set_call.lineno}"
        if "hard-coded" in desc:
            why = (
                f"{named} (given to `triton.set_allocator` at {where}) allocates the global scratch of "
                f"device-side TMA descriptors on {desc}: every launch that needs scratch gets it there, "
                "whatever device the kernel runs on"
            )
        else:
            launch = _unguarded_scratch_launch(project)
            if launch is None:
                continue  # "cuda" at a guarded launch is the guarded device
            lm, site = launch
            why = (
                f"{named} (given to `triton.set_allocator` at {where}) allocates the global scratch of "
                f"device-side TMA descriptors on {desc}: Triton calls it inside the launch, and the launch "
                f"of {site.describe()} ({lm.path}:{site.call.lineno}) is outside a device guard, so its "
                "scratch, like the launch, lands on the current device, not on its tensors' device"
            )
        project.add(
            m,
            node,
            Rule.DEFAULT_DEVICE_ALLOC,
            why,
            "with torch.cuda.device(x.device):  # around the launch: the allocator's 'cuda' is then x's device\n"
            "    kernel[grid](...)",
        )


def _unguarded_scratch_launch(project: Project) -> tuple[Module, LaunchSite] | None:
    """The first launch in the linted files, outside a guard, of a kernel that may need scratch."""
    for lm in project.modules:
        if lm.path not in project.linted:
            continue
        for call in project.launches[lm]:
            site = project.launch_site(call)
            if site is not None and _may_need_scratch(project, site) and project.unguarded_sites(lm, call):
                return lm, site
    return None


def _may_need_scratch(project: Project, site: LaunchSite) -> bool:
    """A launched kernel makes a device-side tensor descriptor (itself or a jit function it
    calls in its file), or is not defined in the project (it may)."""
    for kernel in site.kernels:
        name = kernel.rsplit(".", 1)[-1]
        defs = [(o, o.jit_defs[name]) for o in project.modules if name in o.jit_defs]
        if not defs:
            return True
        for o, func in defs:
            called = {func.name}
            todo = [func]
            while todo:
                f = todo.pop()
                for n in ast.walk(f):
                    if isinstance(n, ast.Call):
                        callee = last(o.canon(n.func))
                        if callee in _DESCRIPTOR_MAKERS:
                            return True
                        if callee in o.jit_defs and callee not in called:
                            called.add(callee)
                            todo.append(o.jit_defs[callee])
    return False


def _is_wrapper(project: Project, m: Module, func: FuncDef) -> bool:
    """A kernel wrapper: it launches a Triton kernel or takes tensor arguments."""
    if any(m.func_of(c) is func for c in project.launches[m]):
        return True
    args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
    return any(a.annotation is not None and "Tensor" in text(a.annotation) for a in args)


def _tensor_param(func: FuncDef) -> str:
    """The parameter to take the device from in the fix (the first tensor, else the first)."""
    args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
    for a in args:
        if a.annotation is not None and "Tensor" in text(a.annotation):
            return a.arg
    plain = [a.arg for a in args if a.arg not in ("self", "cls", "ctx")]
    return plain[0] if plain else "x"


def _default_device_of(m: Module, call: ast.Call) -> str | None:
    """How ``call`` allocates on a device not taken from a tensor; None when it does not."""
    name = m.canon(call.func) or ""
    if name.startswith("torch.") and name.count(".") == 1 and last(name) in FACTORIES:
        desc = undeviced(m, kwarg(call, "device"))
        return f"device={desc}" if desc else None
    if isinstance(call.func, ast.Attribute):
        attr = call.func.attr
        if dotted(call.func.value) in ("torch", "torch.cuda", "tl", "triton"):
            return None
        if attr in NEW_METHODS:
            desc = undeviced(m, kwarg(call, "device"))
            return f"device={desc}" if desc else None
        if attr == "cuda":
            device = arg(call, 0, "device")
            if device is None:
                return "`.cuda()` (the current device)"
            desc = undeviced(m, device)
            return f".cuda({desc})" if desc else None
        if attr == "to":
            device = arg(call, 0, "device")
            if isinstance(device, ast.Constant) and isinstance(device.value, int):
                return None  # .to(0) is rare and ambiguous next to dtypes
            desc = undeviced(m, device)
            return f".to({desc})" if desc else None
    return None
