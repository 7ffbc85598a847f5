"""Which arguments of a launch hold tensors, worked out once per kernel and argument layout.

A layout is what a launch passes by keyword (the names, in order) and the type of every value.
The hot path builds that key (``tuple(map(type, values))`` runs in C), finds the kernel's
:class:`Layout` in a dict and picks the tensors with an ``itemgetter``: no per-argument Python
loop. The key holds the type of *every* value, so a tensor passed where a launch of the same
layout passed an int or None is a new layout, never a missed tensor.

Values whose type is neither plain nor a tensor (a ``TensorDescriptor``, a tuple) are read per
launch (their ``base`` tensor, their tensor items, one level): a layout with one is not
``simple`` and takes :meth:`Layout.expand`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

#: Argument types that never hold a tensor.
PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None)})

_Pick = Callable[[Sequence[Any]], tuple[Any, ...]]


def _picker(slots: Sequence[int]) -> _Pick:
    """``values -> (values[i] for i in slots)`` as a tuple, in C where it can be."""
    if not slots:
        return lambda values: ()
    if len(slots) == 1:
        only = slots[0]
        return lambda values: (values[only],)
    get: _Pick = itemgetter(*slots)
    return get


class Layout:
    """The tensor arguments of one argument layout of one kernel."""

    __slots__ = ("expand_slots", "names", "pick", "simple", "tensor_type")

    def __init__(
        self, names: tuple[str, ...], slots: Sequence[int], others: Sequence[tuple[int, str, bool]], tensor_type: Any
    ) -> None:
        #: the tensors' names, in argument order (simple layouts only)
        self.names = names
        #: the tensor arguments of a launch of this layout (simple layouts only)
        self.pick = _picker(slots)
        #: every argument is plain or a tensor: ``pick`` is the whole story
        self.simple = not others
        #: (index, name, is a tensor) of every argument that is not plain, for ``expand``
        self.expand_slots = tuple(others)
        self.tensor_type = tensor_type

    def expand(self, values: Sequence[Any]) -> tuple[tuple[str, ...], tuple[Any, ...]]:
        """(names, tensors) of a launch of a layout that is not simple: a descriptor's ``base``
        (``x_desc.base``), a tuple's tensor items (``ptrs[1]``)."""
        names: list[str] = []
        tensors: list[Any] = []
        tensor_type = self.tensor_type
        for index, name, is_tensor in self.expand_slots:
            value = values[index]
            if is_tensor:
                names.append(name)
                tensors.append(value)
            elif isinstance(value, (tuple, list)):
                for j, item in enumerate(value):
                    if isinstance(item, tensor_type):
                        names.append(f"{name}[{j}]")
                        tensors.append(item)
            else:
                base = getattr(value, "base", None)
                if isinstance(base, tensor_type):
                    names.append(f"{name}.base")
                    tensors.append(base)
        return tuple(names), tuple(tensors)


def make_layout(arg_names: Sequence[str], kwnames: Sequence[str], values: Sequence[Any], tensor_type: Any) -> Layout:
    """The layout of a launch passing ``values``: the first ``len(values) - len(kwnames)`` by
    position (named after the kernel's parameters ``arg_names``), the rest by ``kwnames``.
    ``tensor_type``: ``torch.Tensor`` (None while torch is not loaded: no value is a tensor)."""
    if tensor_type is None:
        return Layout((), (), (), None)
    positional = len(values) - len(kwnames)
    names = [arg_names[i] if i < len(arg_names) else f"arg{i}" for i in range(positional)] + list(kwnames)
    slots: list[int] = []
    others: list[tuple[int, str, bool]] = []
    for index, (name, value) in enumerate(zip(names, values, strict=True)):
        cls = type(value)
        if cls in PLAIN:
            continue
        is_tensor = tensor_type is not None and issubclass(cls, tensor_type)
        if is_tensor:
            slots.append(index)
        others.append((index, name, is_tensor))
    simple = all(is_tensor for _, _, is_tensor in others)
    return Layout(
        tuple(names[i] for i in slots),
        slots,
        () if simple else others,
        tensor_type,
    )


__all__ = ["PLAIN", "Layout", "make_layout"]
