"""The scan's autotune policy inside the probe child, and what the kernel's autotuners did.

``qmoe_doctor.core.autotune`` says what the policies mean; this applies them to every
``triton.runtime.autotuner.Autotuner`` of the process (the kernel under test's, whatever module
holds it) by wrapping ``Autotuner.run`` once, at class level, for as long as the child lives:

* ``first``: the autotuner's own pruning (``prune_configs``) picks the candidates and the first
  one runs, without benchmarking; one that the device refuses (``OutOfResources``, a ptxas
  failure, a compile-time assert: the errors the autotuner itself scores as infinitely slow) is
  passed over for the next;
* ``cached`` / ``full``: the autotuner runs as written (``cached`` differs only by the
  environment the parent gave the process);
* the repeat-call probe (``real=True``) autotunes for real under every policy: it reads no
  on-disk result (that would skip the benchmark whose runs on the caller's buffers are the
  first-call fault), and under ``first`` it benchmarks the first two kept configs only.

``record()`` collects, per kernel call, how many autotuned launches there were and whether any of
them benchmarked, so that a repeat-call cell whose first call did not benchmark is reported as
unable to see a first-call fault (``docs/cells.md``), never as a pass.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from qmoe_doctor.core.autotune import DEFAULT_AUTOTUNE, AutotunePolicy

#: Configs the repeat-call probe benchmarks under ``first``: two, so the autotuner really runs
#: its benchmark (one config is taken without running it).
REAL_CONFIGS_UNDER_FIRST = 2


@dataclass(slots=True)
class AutotuneRecord:
    """What the autotuners did during one kernel call."""

    calls: int = 0  # autotuned kernel launches (Autotuner.run)
    benchmarked: int = 0  # of them, how many benchmarked configs
    configs: list[str] = field(default_factory=list)  # the config each launch ran


@dataclass(slots=True)
class _State:
    policy: AutotunePolicy = DEFAULT_AUTOTUNE
    real: bool = False
    record: AutotuneRecord | None = None


_STATE = _State()
_INSTALLED: list[bool] = []


def _refusals() -> tuple[type[BaseException], ...]:
    """The errors the autotuner scores as an unusable config (``Autotuner._bench``)."""
    found: list[type[BaseException]] = []
    with contextlib.suppress(ImportError):
        from triton.runtime.errors import OutOfResources

        found.append(OutOfResources)
    with contextlib.suppress(ImportError):
        from triton.runtime.errors import PTXASError

        found.append(PTXASError)
    with contextlib.suppress(ImportError):
        from triton.compiler.errors import CompileTimeAssertionFailure

        found.append(CompileTimeAssertionFailure)
    return tuple(found)


@contextlib.contextmanager
def _attrs(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the block (only those the object has), restore them after."""
    saved = {k: getattr(obj, k) for k in values if hasattr(obj, k)}
    for k in saved:
        setattr(obj, k, values[k])
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


def _config_name(config: Any) -> str:
    kwargs = getattr(config, "kwargs", {}) or {}
    parts = [f"{k}={v}" for k, v in sorted(kwargs.items())]
    parts += [f"num_warps={getattr(config, 'num_warps', '?')}", f"num_stages={getattr(config, 'num_stages', '?')}"]
    return ", ".join(parts)


def _pruned(tuner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The configs the autotuner itself would benchmark for this call (its pruning, its perf
    model), in its order."""
    tuner.nargs = dict(zip(tuner.arg_names, args, strict=False))
    try:
        return list(tuner.prune_configs(kwargs))
    finally:
        tuner.nargs = None


def _wrapped_run(original: Callable[..., Any]) -> Callable[..., Any]:
    refusals = _refusals()

    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _STATE
        record = state.record
        configs = list(getattr(self, "configs", []) or [])
        if len(configs) <= 1 or kwargs.get("warmup"):
            return original(self, *args, **kwargs)
        if record is not None:
            record.calls += 1
        self.__dict__.pop("bench_time", None)  # set again only if this call benchmarks

        def ran(result: Any) -> Any:
            if record is not None:
                if "bench_time" in self.__dict__:
                    record.benchmarked += 1
                best = getattr(self, "best_config", None)
                if best is not None:
                    record.configs.append(_config_name(best))
            return result

        if state.real:
            if state.policy is AutotunePolicy.FIRST:
                chosen = _pruned(self, args, kwargs)[:REAL_CONFIGS_UNDER_FIRST]
                with _attrs(self, configs=chosen, early_config_prune=None, perf_model=None, cache_results=False):
                    return ran(original(self, *args, **kwargs))
            with _attrs(self, cache_results=False):
                return ran(original(self, *args, **kwargs))
        if state.policy is not AutotunePolicy.FIRST:
            return ran(original(self, *args, **kwargs))
        last: BaseException | None = None
        for config in _pruned(self, args, kwargs):
            with _attrs(self, configs=[config]):
                try:
                    return ran(original(self, *args, **kwargs))
                except refusals as exc:  # the device cannot run this one: the next, as the autotuner does
                    last = exc
        assert last is not None  # prune_configs returns at least one config
        raise last

    return run


def install() -> bool:
    """Wrap ``Autotuner.run`` once per process. False where Triton has no autotuner to wrap."""
    if _INSTALLED:
        return True
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return False
    Autotuner.run = _wrapped_run(Autotuner.run)
    _INSTALLED.append(True)
    return True


def set_policy(policy: AutotunePolicy, *, real: bool) -> None:
    """The policy for the probe about to run (``real``: it autotunes for real)."""
    _STATE.policy = policy
    _STATE.real = real


@contextlib.contextmanager
def record() -> Iterator[AutotuneRecord]:
    """Collect what the autotuners do inside the block."""
    rec = AutotuneRecord()
    outer = _STATE.record
    _STATE.record = rec
    try:
        yield rec
    finally:
        _STATE.record = outer


__all__ = ["REAL_CONFIGS_UNDER_FIRST", "AutotuneRecord", "install", "record", "set_policy"]
