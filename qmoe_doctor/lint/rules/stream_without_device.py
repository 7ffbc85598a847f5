"""``stream-without-device``: ``current_stream()`` without a device outside a guard, or a default
(null) stream or an undeviced ``Stream()`` used for a launch.

A stream *is used for a launch* when it is passed to ``kernel[grid](..., stream=s)`` or entered
with ``torch.cuda.stream(s)`` around work (a launch, a linted function that launches, or a
function from outside that may), directly, through the name it is assigned to, or through a
helper that returns the stream context.
"""

from __future__ import annotations

import ast

from qmoe_doctor.lint.devices import STREAM_CONTEXTS, stream_device
from qmoe_doctor.lint.findings import Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import src
from qmoe_doctor.lint.project import Project


def check(project: Project, m: Module) -> None:
    for node in m.calls:
        if m.exempt(node):
            continue
        name = m.canon(node.func) or ""
        if name == "torch.cuda.current_stream":
            where = stream_device(m, node)
            if where == "literal" or (where == "none" and not project.guarded(m, node)):
                what = "a hard-coded device" if where == "literal" else "no device argument"
                project.add(
                    m,
                    node,
                    Rule.STREAM_WITHOUT_DEVICE,
                    f"`{src(node)}` with {what} outside a device guard returns the current "
                    "device's stream, not the stream of the tensors' device",
                    "with torch.cuda.device(x.device):\n    stream = torch.cuda.current_stream(x.device)",
                )
        elif name in ("torch.cuda.default_stream", "torch.cuda.Stream", "torch.cuda.streams.Stream"):
            where = stream_device(m, node)
            default = name.endswith("default_stream")
            if not default and (where == "explicit" or (where == "none" and project.guarded(m, node))):
                continue  # a side stream of the tensors' (or the guarded) device
            if not _used_for_launch(project, m, node):
                continue
            if default:
                what = "the null stream, unordered against the caller's current stream"
                if where != "explicit":
                    what += f" (and of {'the current' if where == 'none' else 'a hard-coded'} device)"
                fix = (
                    "with torch.cuda.device(x.device):\n"
                    "    kernel[grid](...)  # on the caller's current stream of x.device"
                )
            else:
                what = f"a stream of {'the current' if where == 'none' else 'a hard-coded'} device"
                fix = "side = torch.cuda.Stream(device=x.device)\nside.wait_stream(torch.cuda.current_stream(x.device))"
            project.add(
                m,
                node,
                Rule.STREAM_WITHOUT_DEVICE,
                f"`{src(node)}` is used for a launch: it is {what}, so the kernel is not "
                "ordered after the producer of its inputs",
                fix,
            )


def _used_for_launch(project: Project, m: Module, stream_call: ast.Call) -> bool:
    """The stream made by ``stream_call`` is passed to a launch, or entered with
    ``torch.cuda.stream(...)`` around work (directly, through the name it is assigned to, or
    through a helper that returns the stream context)."""
    refs: list[ast.AST] = [stream_call]
    parent = m.parents.get(stream_call)
    if isinstance(parent, ast.Assign):
        names = {t.id for t in parent.targets if isinstance(t, ast.Name)}
        scope: ast.AST = m.func_of(stream_call) or m.tree
        refs += [n for n in m.shallow(scope) if isinstance(n, ast.Name) and n.id in names]
    for ref in refs:
        for anc in m.ancestors(ref):
            if isinstance(anc, ast.Call) and project.kernel_name(m, anc) is not None:
                return True  # kernel[grid](..., stream=s)
            if isinstance(anc, ast.Call) and (m.canon(anc.func) or "") in STREAM_CONTEXTS:
                if _context_runs_work(project, m, anc):
                    return True
                break
            if isinstance(anc, ast.stmt):
                break
    return False


def _context_runs_work(project: Project, m: Module, ctx: ast.Call) -> bool:
    parent = m.parents.get(ctx)
    if isinstance(parent, ast.withitem):
        with_node = m.parents.get(parent)
        return isinstance(with_node, (ast.With, ast.AsyncWith)) and _body_runs_work(project, m, with_node)
    if isinstance(parent, ast.Return):  # def _default_stream(d): return torch.cuda.stream(...)
        func = m.func_of(ctx)
        for cm, call in project.callers(m, func) if func is not None else []:
            item = cm.parents.get(call)
            with_node = cm.parents.get(item) if isinstance(item, ast.withitem) else None
            if isinstance(with_node, (ast.With, ast.AsyncWith)) and _body_runs_work(project, cm, with_node):
                return True
    return False


def _body_runs_work(project: Project, m: Module, node: ast.With | ast.AsyncWith) -> bool:
    """The block launches a kernel, calls a linted function that does, or calls a function
    from outside (not torch, not a builtin) that may."""
    for stmt in node.body:
        for n in ast.walk(stmt):
            if not isinstance(n, ast.Call):
                continue
            if project.kernel_name(m, n) is not None:
                return True
            callee = n.func.id if isinstance(n.func, ast.Name) else None
            if callee is None:
                continue
            if project.function_launches(callee):
                return True
            full = m.aliases.get(callee)
            if full is not None and not full.startswith(("torch", "triton")):
                return True
    return False
