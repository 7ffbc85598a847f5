"""The device checks of one Triton launch: pure functions over what the launch monitor recorded.

The monitor (``qmoe_doctor.monitor``, inside the user's process) calls :func:`check_launch`
when its cheap pre-check sees something off at a launch; ``qmoe-doctor run`` reads the findings
back. Nothing here imports torch or reads a tensor: the facts are metadata (device, pointer,
shape, strides, dtype) taken at the launch, and peer access is a question the caller answers
(``torch.cuda.can_device_access_peer``, asked only when torch is already imported).

One function per fact, each naming a cause of ``core.causes``:

* :func:`other_device` (``missing-device-guard``): a tensor on another GPU than the one Triton
  launches on (the current device). Without peer access Triton refuses the pointer ("Pointer
  argument ... cannot be accessed from Triton"); with it the kernel runs remotely over
  NVLink/PCIe, several times slower and unordered against the tensors' own stream.
* :func:`mixed_devices` (``default-device-buffer``): the tensors of one launch on several GPUs.
* :func:`cpu_tensor` (``default-device-buffer``): a CPU tensor passed to a GPU launch.
* :func:`int32_by_size` (``int32-offset-overflow``): a tensor whose element span reaches 2**31
  passed to a kernel whose source forms an offset product in int32 (found by the lint).
* :func:`device_never_set` (``device-never-set``): in a launcher's rank r != 0 (``LOCAL_RANK``),
  a launch whose tensors sit on cuda:r with one on cuda:0, or that runs on cuda:0: the rank never
  made cuda:r current. It is the one cause of that launch's cross-GPU tensors: the guard and
  mixed-device findings it explains are not made.

Checks over many launches (a kernel's stream against its neighbours') are ``diagnose.stream_rules``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qmoe_doctor.core.launches import (
    INT32_LIMIT,
    FindingKind,
    LaunchFacts,
    LaunchFinding,
    TensorArg,
)

#: ``peer_access(launch_gpu, tensor_gpu)``: can the launch device map the tensor's GPU memory
#: (None: unknown). A capability, not whether peer access is enabled in the process.
PeerAccess = Callable[[int, int], bool | None]

_DTYPE_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def describe(t: TensorArg) -> str:
    """``w_ptr (160 x 5120 x 6144 bf16)``"""
    dims = " x ".join(str(d) for d in t.shape) or "scalar"
    return f"{t.name} ({dims} {_DTYPE_SHORT.get(t.dtype, t.dtype)})"


def _names(tensors: Sequence[TensorArg]) -> str:
    return ", ".join(t.name for t in tensors)


def _gpu_index(device: str | None) -> int | None:
    if device is None:
        return None
    kind, _, index = device.partition(":")
    return int(index) if kind != "cpu" and index.isdigit() else None


def _consequence(launch: str, other: str, peer: bool | None) -> str:
    """What a launch on ``launch`` makes of pointers on ``other``, by peer access."""
    if peer is None:
        return "without peer access Triton refuses the pointer; with it the kernel runs remotely"
    if peer:
        return (
            f"{launch} can reach {other} over peer access, so once it is enabled (any copy "
            f"{launch} -> {other} does) the kernel runs remotely: several times slower and "
            f"unordered against {other}'s stream"
        )
    return f"{launch} cannot reach {other} (no peer access): the launch fails"


def other_device(facts: LaunchFacts, peer_access: PeerAccess | None = None) -> list[LaunchFinding]:
    """One finding per GPU, other than the launch device, that holds tensors of the launch."""
    launch_gpu = _gpu_index(facts.device)
    if launch_gpu is None:
        return []
    by_device: dict[str, list[TensorArg]] = {}
    for t in facts.tensors:
        index = t.device_index
        if index is not None and index != launch_gpu:
            by_device.setdefault(t.device, []).append(t)
    out: list[LaunchFinding] = []
    for device, tensors in by_device.items():
        tensor_gpu = tensors[0].device_index
        assert tensor_gpu is not None
        peer = peer_access(launch_gpu, tensor_gpu) if peer_access is not None else None
        consequence = _consequence(str(facts.device), device, peer)
        out.append(
            LaunchFinding(
                kind=FindingKind.OTHER_DEVICE,
                cause="missing-device-guard",
                kernel=facts.kernel,
                message=(
                    f"`{facts.kernel}` launched on {facts.device} (the current device) with "
                    f"{_names(tensors)} on {device}: {consequence}"
                ),
                launch_device=facts.device,
                tensors=tuple(tensors),
                peer_access=peer,
                first_seq=facts.seq,
            )
        )
    return out


def device_never_set(facts: LaunchFacts, peer_access: PeerAccess | None = None) -> list[LaunchFinding]:
    """A launcher's rank r != 0 whose launch has at least half of its GPU tensors (one at least)
    on cuda:r, the rest on cuda:0, and either a tensor on cuda:0 or the launch itself on cuda:0
    (launched on cuda:0 or cuda:r only). The rank never called ``torch.cuda.set_device(r)``: its
    current device is still cuda:0, where ``device="cuda"`` buffers and unguarded launches go.
    A third GPU, or a rank's tensors mostly on cuda:0, is left to the other checks."""
    rank = facts.local_rank
    launch_gpu = _gpu_index(facts.device)
    if rank is None or rank <= 0 or launch_gpu not in (0, rank):
        return []
    gpus = [t for t in facts.tensors if t.device_index is not None]
    own = [t for t in gpus if t.device_index == rank]
    zero = [t for t in gpus if t.device_index == 0]
    if not own or len(own) + len(zero) != len(gpus) or len(own) < len(zero):
        return []
    if not zero and launch_gpu != 0:
        return []
    gpu = f"cuda:{rank}"
    parts = [f"{_names(own)} on {gpu} (the rank's GPU)"]
    if zero:
        parts.append(f"{_names(zero)} on cuda:0")
    follows = " and ".join(
        what
        for what, there in (("a buffer made with device='cuda'", zero), ("an unguarded launch", launch_gpu == 0))
        if there
    )
    other = 0 if launch_gpu == rank else rank
    peer = peer_access(launch_gpu, other) if peer_access is not None else None
    return [
        LaunchFinding(
            kind=FindingKind.RANK_ON_DEVICE_0,
            cause="device-never-set",
            kernel=facts.kernel,
            message=(
                f"`{facts.kernel}` in the rank of LOCAL_RANK={rank}, launched on {facts.device} with "
                f"{'; '.join(parts)}: this rank never called torch.cuda.set_device({rank}), so its "
                f"current device is still cuda:0 and {follows} went there; "
                f"{_consequence(str(facts.device), f'cuda:{other}', peer)}"
            ),
            launch_device=facts.device,
            tensors=(*own, *zero),
            peer_access=peer,
            first_seq=facts.seq,
        )
    ]


def mixed_devices(facts: LaunchFacts) -> list[LaunchFinding]:
    """The tensors of one launch on more than one GPU (CPU tensors are :func:`cpu_tensor`'s)."""
    gpus: dict[str, list[TensorArg]] = {}
    for t in facts.tensors:
        if t.device_index is not None:
            gpus.setdefault(t.device, []).append(t)
    if len(gpus) < 2:
        return []
    parts = "; ".join(f"{_names(ts)} on {device}" for device, ts in gpus.items())
    hint = ""
    if facts.device in gpus:
        hint = (
            f" ({_names(gpus[facts.device])} on {facts.device}, the current device: a buffer made "
            "with device='cuda' or on the current device fits)"
        )
    return [
        LaunchFinding(
            kind=FindingKind.MIXED_DEVICES,
            cause="default-device-buffer",
            kernel=facts.kernel,
            message=f"`{facts.kernel}` mixes tensors of {len(gpus)} GPUs in one launch: {parts}{hint}",
            launch_device=facts.device,
            tensors=tuple(t for ts in gpus.values() for t in ts),
            first_seq=facts.seq,
        )
    ]


def cpu_tensor(facts: LaunchFacts) -> list[LaunchFinding]:
    """CPU tensors passed to a launch on a GPU (the interpreter runs on the CPU: not flagged)."""
    if _gpu_index(facts.device) is None:
        return []
    on_cpu = [t for t in facts.tensors if t.device == "cpu"]
    if not on_cpu:
        return []
    return [
        LaunchFinding(
            kind=FindingKind.CPU_TENSOR,
            cause="default-device-buffer",
            kernel=facts.kernel,
            message=(
                f"`{facts.kernel}` launched on {facts.device} with {_names(on_cpu)} on the CPU: Triton "
                "refuses a pageable CPU pointer (\"cannot be accessed from Triton (cpu tensor?)\"); "
                "a buffer made without device=x.device fits"
            ),
            launch_device=facts.device,
            tensors=tuple(on_cpu),
            first_seq=facts.seq,
        )
    ]


def int32_by_size(facts: LaunchFacts) -> list[LaunchFinding]:
    """A tensor that spans 2**31 elements or more, passed to a kernel whose lint found an int32
    offset product: the product wraps for the elements past 2**31 - 1."""
    if not facts.int32_lint:
        return []
    big = [t for t in facts.tensors if t.span >= INT32_LIMIT]
    if not big:
        return []
    lines = ", ".join(str(n.line) for n in facts.int32_lint)
    sizes = "; ".join(f"{describe(t)} spans {t.span:,} elements" for t in big)
    return [
        LaunchFinding(
            kind=FindingKind.INT32_BY_SIZE,
            cause="int32-offset-overflow",
            kernel=facts.kernel,
            message=(
                f"`{facts.kernel}` forms offset products in int32 (line {lines} of "
                f"{facts.int32_lint[0].path}) and got {sizes}, past 2**31 - 1 = {INT32_LIMIT - 1:,}: "
                "offsets into the far elements wrap (silently wrong, or an illegal address)"
            ),
            launch_device=facts.device,
            tensors=tuple(big),
            lint=facts.int32_lint,
            first_seq=facts.seq,
        )
    ]


#: The checks that run whatever explains the launch's GPUs, after them.
CHECKS: tuple[Callable[[LaunchFacts], list[LaunchFinding]], ...] = (cpu_tensor, int32_by_size)
#: The findings ``--strict`` stops a launch for: a tensor on another device than the launch's.
_CROSS_DEVICE = frozenset(
    {FindingKind.OTHER_DEVICE, FindingKind.MIXED_DEVICES, FindingKind.CPU_TENSOR, FindingKind.RANK_ON_DEVICE_0}
)


def check_launch(facts: LaunchFacts, peer_access: PeerAccess | None = None) -> tuple[LaunchFinding, ...]:
    """Every finding of one launch, one cause per fault:

    * when :func:`device_never_set` explains its GPUs, the guard and mixed-device findings of the
      same tensors are not made;
    * when most of its tensor bytes are on the launch device and the rest on other GPUs, the
      launch is where its operands live and the stray tensors are buffers made on another device:
      :func:`mixed_devices` (``default-device-buffer``) only, not also a missing guard for the
      stray ones (``specimen:default_buffer`` under ``device_map`` on 2x H100, 2026-11-25, was
      reported under both causes before).
    """
    found = device_never_set(facts, peer_access)
    if not found:
        mixed = mixed_devices(facts)
        found = [] if mixed and _launch_device_holds_most(facts) else other_device(facts, peer_access)
        found.extend(mixed)
    for check in CHECKS:
        found.extend(check(facts))
    return tuple(found)


def _launch_device_holds_most(facts: LaunchFacts) -> bool:
    """More of the launch's GPU tensor bytes on the launch device than on any other GPU: the
    operands live there (bytes, not a count: several small metadata buffers made on the current
    device beside the operands on another GPU are a missing guard, not a stray output)."""
    held: dict[int, int] = {}
    for t in facts.tensors:
        if t.device_index is not None:
            held[t.device_index] = held.get(t.device_index, 0) + t.nbytes
    launch_gpu = _gpu_index(facts.device)
    here = held.pop(launch_gpu, 0) if launch_gpu is not None else 0
    return here > 0 and all(here > n for n in held.values())


def cross_device(finding: LaunchFinding) -> bool:
    """Whether ``--strict`` stops the launch: a tensor another device than the launch's."""
    return finding.kind in _CROSS_DEVICE


__all__ = [
    "CHECKS",
    "PeerAccess",
    "check_launch",
    "cpu_tensor",
    "cross_device",
    "describe",
    "device_never_set",
    "int32_by_size",
    "mixed_devices",
    "other_device",
]
