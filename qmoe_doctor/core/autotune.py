"""How a scan treats the autotuner of the kernel under test: ``--autotune {first,cached,full}``.

A public fused-MoE kernel autotunes over about a thousand configs keyed on the shape; measured on
one H100 (FINDINGS.md, 2026-11-25) its first call in a fresh process took 74 s from a cold Triton
cache, and a one-GPU scan, five probe processes each re-running it, took 382 s. The policies:

``first`` (the default)
    Every probe runs the first config the kernel's own autotuner keeps after its own pruning
    (``prune_configs_by``), without benchmarking; a config the device cannot compile or launch
    (out of resources) is passed over for the next, as the autotuner itself would. Only the
    repeat-call probe autotunes for real, on the first two kept configs and on the caller's
    buffers, the one place where a first-call fault of an autotuned kernel shows
    (``autotune-inplace-rerun``). Cells exercise that one config, not the one the autotuner
    would pick: the fastest policy, one compile per distinct shape.
``cached``
    Every probe autotunes as the kernel does, but the result is kept on disk and shared by every
    probe process of the scan (``TRITON_CACHE_AUTOTUNING=1`` and one ``TRITON_CACHE_DIR``): a
    key is benchmarked once per scan. The repeat-call probe still benchmarks for real (it reads
    no cached result). Cells exercise the autotuner's own choice.
``full``
    Nothing changed: each probe process autotunes every new key, as the kernel does in a
    fresh process (the repeat-call probe reads no cached result). The slowest.

Stdlib only: the planner puts the policy in each spec's ``params`` and the environment in each
session's; the probe child (``probes/autotune.py``) applies it.
"""

from __future__ import annotations

from qmoe_doctor.core import knobs
from qmoe_doctor.core.compat import StrEnum

#: The ``ProbeSpec.params`` key that carries the policy to the probe child.
PARAM = "autotune"
#: Under ``cached``: the scan's own Triton cache, a folder of the scan's log folder (kept and
#: removed with it), so no result of an earlier scan or of the user's own runs is read, and none
#: is left in theirs. Its price: the scan compiles from a cold cache.
SCAN_CACHE_DIR = "triton-cache"


class AutotunePolicy(StrEnum):
    FIRST = "first"
    CACHED = "cached"
    FULL = "full"


DEFAULT_AUTOTUNE = AutotunePolicy.FIRST


def parse_policy(text: str) -> AutotunePolicy:
    """``--autotune`` and ``params["autotune"]``: one of first, cached, full. Raises ValueError."""
    try:
        return AutotunePolicy(text.strip().lower())
    except ValueError:
        known = ", ".join(p.value for p in AutotunePolicy)
        raise ValueError(f"--autotune {text!r}: expected one of {known}") from None


def session_env(policy: AutotunePolicy, cache_dir: str | None) -> dict[str, str]:
    """What every probe process of a scan gets for ``policy``: under ``cached``, Triton's on-disk
    autotune results on, in one cache folder for the whole scan (``cache_dir``; None keeps
    Triton's default folder, shared with the user's own runs). Nothing for the other policies."""
    if policy is not AutotunePolicy.CACHED:
        return {}
    env = {knobs.TRITON_CACHE_AUTOTUNING: "1"}
    if cache_dir:
        env[knobs.TRITON_CACHE_DIR] = cache_dir
    return env


def probe_params(policy: AutotunePolicy) -> dict[str, str]:
    """The spec params that carry ``policy`` to the probe child."""
    return {PARAM: policy.value}


def policy_of(params: dict[str, object]) -> AutotunePolicy:
    """The policy a spec asks for (``DEFAULT_AUTOTUNE`` when it names none or an unknown one:
    a spec from an older parent)."""
    raw = params.get(PARAM)
    if isinstance(raw, str):
        try:
            return parse_policy(raw)
        except ValueError:
            return DEFAULT_AUTOTUNE
    return DEFAULT_AUTOTUNE


__all__ = [
    "DEFAULT_AUTOTUNE",
    "PARAM",
    "SCAN_CACHE_DIR",
    "AutotunePolicy",
    "parse_policy",
    "policy_of",
    "probe_params",
    "session_env",
]
