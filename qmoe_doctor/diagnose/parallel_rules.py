"""Classification of the parallel modes' ranks: the scan's generic rules, then one rule per
parallel cause, in the table ``RULES``.

=====================  ===============================================  ==========================
rule                   what it reads                                     what it says
=====================  ===============================================  ==========================
device-never-set       dp, tp, ep ranks whose current device after       names the ranks, against
                       set-up is not their own, with work or memory      a rank whose current
                       landed there (kernel calls, allocations,          device is its own, and the
                       contexts)                                         rank's own single-device
                                                                         run
invalid-routing        ep ranks that received local expert ids outside   names the ranks; a peer
                       their stack, or whose own experts are wrong       whose own experts are right
                                                                         is explained
followers              ranks that failed because another did: stopped    explanations only
                       by torchrun, a collective that waited for failed
                       ranks, a rank whose single-device run is wrong
=====================  ===============================================  ==========================

Each rank's own single-device run (``parallel.single``: the same weights and inputs with all
experts on its device) is the baseline. A rank is named by its placement ("rank 1", the CUDA
ordinal and the GPU it ran on); no probe id is taken apart.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from qmoe_doctor.core.modes import MODE_OF
from qmoe_doctor.core.records import (
    Condition,
    Confidence,
    Diagnosis,
    ErrorKind,
    Evidence,
    Outcome,
    Status,
)
from qmoe_doctor.diagnose.matrix import cell_label
from qmoe_doctor.diagnose.scan_rules import Classification, Finding, classify

# ---------------------------------------------------------------------------------------------
# What the rules read of a rank
# ---------------------------------------------------------------------------------------------


def describe_outcome(outcome: Outcome) -> str:
    """One line: what a rank showed (its failing checks, its error, or "correct" and its step)."""
    if outcome.status is Status.ERROR:
        lines = (outcome.error_message or "").strip().splitlines()
        return f"{outcome.error_type or 'error'}: {lines[0][:200] if lines else outcome.error_kind}"
    checks = outcome.facts.get("parallel.checks") or []
    bad = [c for c in checks if isinstance(c, dict) and not c.get("ok")]
    parts = [f"{c.get('name')} rel. error {_fmt(c.get('rel_error'))}" for c in bad[:4]]
    if outcome.tolerance is not None and parts:
        parts[-1] += f" (tolerance {outcome.tolerance:g})"
    single = outcome.facts.get("parallel.single") or {}
    if single and not single.get("ok", True):
        parts.append(
            f"its single-device run differs from the torch twin (rel. error {_fmt(single.get('rel_error'))})"
        )
    if parts or outcome.status is not Status.PASS:
        return "; ".join(parts) or str(outcome.status)
    numbered = [c for c in checks if isinstance(c, dict) and isinstance(c.get("rel_error"), (int, float))]
    worst = max(numbered, key=lambda c: float(c["rel_error"]), default=None)
    text = "correct" + (f" (worst: {worst['name']} {_fmt(worst['rel_error'])})" if worst else "")
    step = number(outcome.facts.get("parallel.step_ms"))
    return text + (f", step {step:.1f} ms" if step is not None else "")


def number(value: Any) -> float | None:
    """A fact as a float; None for anything that is not a number (a bool is not)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def _ev(outcome: Outcome, detail: str, label: str | None = None) -> Evidence:
    return Evidence(
        probe_id=outcome.probe_id,
        condition=outcome.spec.condition,
        label=label or cell_label(outcome, None)[0],
        detail=detail,
    )


def _rank_of(outcome: Outcome) -> int | None:
    value = outcome.facts.get("parallel.rank")
    if isinstance(value, int):
        return value
    return outcome.spec.placement.rank


def _single_ok(outcome: Outcome) -> bool | None:
    single = outcome.facts.get("parallel.single")
    return bool(single.get("ok")) if isinstance(single, dict) and "ok" in single else None


def _current_device(outcome: Outcome) -> int | None:
    for key in ("parallel.current_device_after_setup", "parallel.current_device"):
        value = outcome.facts.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _off_device_calls(outcome: Outcome) -> tuple[int, int, list[dict[str, Any]]]:
    calls = outcome.facts.get("parallel.kernel_calls") or {}
    if not isinstance(calls, dict):
        return 0, 0, []
    off = sum(int(v) for v in (calls.get("off_device") or {}).values())
    misplaced = sum(int(v) for v in (calls.get("misplaced") or {}).values())
    return off, misplaced, list(calls.get("examples") or [])


def _foreign(outcome: Outcome, own: int) -> tuple[dict[int, int], list[int]]:
    peaks = outcome.facts.get("parallel.peak_allocated") or {}
    allocs = {int(d): int(b) for d, b in peaks.items() if str(d).isdigit() and int(d) != own and int(b) > 0}
    contexts = [int(c) for c in outcome.facts.get("parallel.contexts") or [] if int(c) != own]
    return allocs, contexts


# ---------------------------------------------------------------------------------------------
# The rule interface
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelContext:
    """What every parallel rule may read: the ranks by mode, and how the run was placed."""

    kernel: str
    by_mode: Mapping[Condition, Sequence[Outcome]]
    gpu_of_ordinal: Mapping[int, int] = field(default_factory=dict)  # child ordinal -> NVML index
    gpus: tuple[int, ...] = ()  # NVML indices the run used (for the repro command)
    cpu: bool = False  # the ranks were CPU processes
    explained: frozenset[str] = frozenset()  # probe ids the rules before this one account for

    def place(self, outcome: Outcome) -> str:
        """The rank as a report names it: "rank 1 (cuda:1, GPU 3)"."""
        head = outcome.spec.placement.group
        ordinal = outcome.spec.device
        if ordinal is None:
            return head
        nvml = self.gpu_of_ordinal.get(ordinal)
        return f"{head} (cuda:{ordinal}" + (f", GPU {nvml})" if nvml is not None else ")")

    def repro(self, condition: Condition) -> str:
        gpus = f" --gpus {','.join(str(g) for g in self.gpus)}" if self.gpus else ""
        cpu = " --cpu" if self.cpu else ""
        return f"qmoe-doctor scan --parallel {MODE_OF[condition].value} --kernel {self.kernel}{gpus}{cpu}"


ParallelRule = Callable[[ParallelContext], Finding]


# ---------------------------------------------------------------------------------------------
# The rules
# ---------------------------------------------------------------------------------------------


def device_never_set(ctx: ParallelContext) -> Finding:
    """A rank whose current device is not its own, and work landed there (dp, tp, ep)."""
    diagnoses: list[Diagnosis] = []
    explanations: list[str] = []
    explained: set[str] = set()
    for condition in (Condition.PARALLEL_DP, Condition.PARALLEL_TP, Condition.PARALLEL_EP):
        ranks = ctx.by_mode.get(condition, [])
        evidence: list[Evidence] = []
        places: list[str] = []
        high = False
        for o in ranks:
            own = o.spec.device
            current = _current_device(o)
            if own is None or current is None or current == own:
                continue
            off, misplaced, examples = _off_device_calls(o)
            allocs, contexts = _foreign(o, own)
            if not (off or misplaced or allocs or o.failed):
                explanations.append(
                    f"{ctx.place(o)}: its current device stayed cuda:{current}, not its own cuda:{own}, "
                    "but nothing of it ran or was allocated there (the kernel follows its tensors' device)"
                )
                continue
            facts = [f"current device cuda:{current} after set-up, its own is cuda:{own}"]
            if off:
                facts.append(f"{off} kernel call(s) made with cuda:{current} current and x on cuda:{own}")
            if misplaced:
                facts.append(f"{misplaced} kernel output(s) returned on another device")
            for d, b in sorted(allocs.items()):
                facts.append(f"torch allocated {b:,} bytes on cuda:{d}")
            if contexts:
                facts.append("CUDA context(s) on " + ", ".join(f"cuda:{c}" for c in contexts))
            if examples:
                ex = examples[0]
                facts.append(
                    f"e.g. {ex.get('what')}: current cuda:{ex.get('current_device')}, x on {ex.get('x_device')}"
                    + (f", output on {ex.get('out_device')}" if ex.get("out_device") else "")
                )
            if o.failed:
                facts.append(describe_outcome(o))
            if _single_ok(o):
                evidence.append(
                    _ev(
                        o,
                        f"same rank, kernel and inputs with cuda:{own} current (its single-device run): correct",
                        "pass",
                    )
                )
                high = True
            evidence.append(_ev(o, "; ".join(facts)))
            explained.add(o.probe_id)
            places.append(ctx.place(o))
        if not evidence:
            continue
        for peer in ranks:  # a rank whose current device is its own, same program
            if (
                peer.probe_id not in explained
                and peer.probe_id not in ctx.explained
                and peer.status is Status.PASS
                and _current_device(peer) == peer.spec.device
            ):
                evidence.append(
                    _ev(peer, f"its current device is its own (cuda:{peer.spec.device}): correct")
                )
                high = True
                break
        diagnoses.append(
            Diagnosis(
                cause="device-never-set",
                confidence=Confidence.HIGH if high else Confidence.MEDIUM,
                summary=(
                    f"under {MODE_OF[condition].value}, {', '.join(places)} never made its own GPU current: "
                    "its current device stayed cuda:0, so whatever follows the current device (a default "
                    "allocation, an unguarded launch) landed on GPU 0 and failed or crossed GPUs"
                ),
                evidence=tuple(evidence),
                where=tuple(places),
                repro=ctx.repro(condition),
            )
        )
    return Finding(
        diagnoses=tuple(diagnoses), explanations=tuple(explanations), accounts_for=frozenset(explained)
    )


def invalid_routing_under_ep(ctx: ParallelContext) -> Finding:
    """Global expert ids reached a rank's local weight stack under expert parallelism."""
    ep_ranks = ctx.by_mode.get(Condition.PARALLEL_EP, [])
    culprits: list[Outcome] = []
    evidence: list[Evidence] = []
    explained: set[str] = set()
    high = False
    for o in ep_ranks:
        f = o.facts
        n_bad = f.get("ep.ids_out_of_range")
        bad_ids = isinstance(n_bad, int) and n_bad > 0
        local_wrong = f.get("ep.local_expert_ok") is False
        if not (bad_ids or (local_wrong and o.failed)) or _single_ok(o) is False:
            continue
        per_rank = f.get("ep.experts_per_rank")
        if _single_ok(o):
            evidence.append(
                _ev(o, "same rank, all experts on one device (its single-device run): correct", "pass")
            )
        facts = []
        if bad_ids:
            examples = f.get("ep.bad_id_examples") or []
            shown = ", ".join(
                f"global {e.get('global')} -> local {e.get('local')}"
                for e in examples[:3]
                if isinstance(e, dict)
            )
            facts.append(
                f"{n_bad} of {f.get('ep.recv_rows')} received rows carry local expert ids outside [0, {per_rank})"
                + (f" ({shown})" if shown else "")
                + ": global ids reached the local weight stack"
            )
        if local_wrong:
            facts.append(
                "its experts' rows differ from the full block's at the rows' global ids "
                f"(rel. error {_fmt(f.get('ep.local_expert_rel_error'))})"
            )
        facts.append(describe_outcome(o))
        evidence.append(_ev(o, "; ".join(facts)))
        high = high or (bad_ids and (local_wrong or o.failed) and _single_ok(o) is True)
        explained.add(o.probe_id)
        culprits.append(o)
    if not culprits:
        return Finding()
    names = [ctx.place(o) for o in culprits]
    for peer in ep_ranks:
        if peer in culprits or not peer.failed:
            continue
        if peer.facts.get("ep.local_expert_ok") is True and not peer.facts.get("ep.ids_out_of_range"):
            evidence.append(
                _ev(
                    peer,
                    f"its own experts are right (rel. error {_fmt(peer.facts.get('ep.local_expert_rel_error'))}); "
                    f"its tokens' rows computed by {', '.join(names)} are not: " + describe_outcome(peer),
                )
            )
            explained.add(peer.probe_id)
            high = True
    diagnosis = Diagnosis(
        cause="invalid-routing",
        confidence=Confidence.HIGH if high else Confidence.MEDIUM,
        summary=(
            f"under expert parallelism {', '.join(names)} indexed its local stack of "
            f"{culprits[0].facts.get('ep.experts_per_rank')} experts with ids past its end: the global "
            "expert ids were not remapped to local ones (ids - first local expert); the same block on "
            "one device is right"
        ),
        evidence=tuple(evidence),
        where=tuple(names),
        repro=ctx.repro(Condition.PARALLEL_EP),
    )
    return Finding(diagnoses=(diagnosis,), accounts_for=frozenset(explained))


def followers(ctx: ParallelContext) -> Finding:
    """Ranks that failed only because another did; and ranks whose own single-device run is
    wrong too (the kernel fails without any parallelism: said, not explained away)."""
    explanations: list[str] = []
    explained: set[str] = set(ctx.explained)
    for condition, ranks in ctx.by_mode.items():
        mode = MODE_OF[condition].value
        failed_first = [o for o in ranks if o.failed and "parallel.terminated_after" not in o.facts]
        for o in ranks:
            after = o.facts.get("parallel.terminated_after")
            if after is None or o.probe_id in explained:
                continue
            if any(_rank_of(f) == after for f in failed_first):
                explanations.append(
                    f"{ctx.place(o)} ({mode}) was stopped by torchrun after rank {after} "
                    f"failed (it was at {o.facts.get('parallel.at', '?')}): not a fault of its own"
                )
                explained.add(o.probe_id)
        # a rank that hung in the step while other ranks of the same run failed with a diagnosed
        # cause: a collective waits for every rank (8 ranks on 8 H200s, 2026-11-22: rank 0 waited for the seven
        # that failed until the parent's timeout). Only with its own single-device run correct,
        # and only when another rank's failure is diagnosed: a hang of its own stays unexplained.
        culprits_here = [ctx.place(f) for f in failed_first if f.probe_id in explained]
        for o in ranks:
            if (
                culprits_here
                and o.error_kind is ErrorKind.TIMEOUT
                and o.probe_id not in explained
                and _single_ok(o) is True
            ):
                explanations.append(
                    f"{ctx.place(o)} ({mode}) timed out at "
                    f"{o.facts.get('parallel.at', '?')} while {', '.join(culprits_here)} had failed (diagnosed "
                    "above): a collective waits for every rank; its own single-device run is correct, so "
                    "not a fault of its own"
                )
                explained.add(o.probe_id)
        for o in ranks:
            if o.failed and o.probe_id not in explained and _single_ok(o) is False:
                explanations.append(
                    f"{ctx.place(o)} ({mode}): its single-device run is wrong too (against "
                    f"the torch twin), so the kernel fails without any parallelism: "
                    f"`qmoe-doctor scan --kernel {ctx.kernel}` names why"
                )
    return Finding(explanations=tuple(explanations), accounts_for=frozenset(explained - ctx.explained))


#: The parallel rules, in the order their findings are reported; each sees what the ones before
#: it accounted for.
RULES: tuple[ParallelRule, ...] = (device_never_set, invalid_routing_under_ep, followers)


def classify_parallel(
    outcomes: Sequence[Outcome],
    *,
    kernel: str,
    gpu_of_ordinal: Mapping[int, int] | None = None,
    gpus: Sequence[int] = (),
    cpu: bool = False,
) -> Classification:
    """The scan's generic rules on the per-rank outcomes, then the parallel ``RULES``.
    ``gpu_of_ordinal`` and ``gpus`` (NVML) name where each rank ran; ``cpu``: CPU ranks."""
    base = classify(outcomes, kernel=kernel)
    by_mode: dict[Condition, list[Outcome]] = {}
    for o in outcomes:
        if o.spec.condition in MODE_OF:
            by_mode.setdefault(o.spec.condition, []).append(o)
    ctx = ParallelContext(
        kernel=kernel,
        by_mode=by_mode,
        gpu_of_ordinal=dict(gpu_of_ordinal or {}),
        gpus=tuple(gpus),
        cpu=cpu,
        explained=frozenset(e.probe_id for d in base.diagnoses for e in d.evidence),
    )
    diagnoses = list(base.diagnoses)
    explanations = list(base.explanations)
    for rule in RULES:
        found = rule(ctx)
        diagnoses += found.diagnoses
        explanations += found.explanations
        ctx = replace(ctx, explained=ctx.explained | found.accounts_for)
    by_id = {o.probe_id: o for o in outcomes}
    unexplained = tuple(
        replace(e, detail=describe_outcome(by_id[e.probe_id])) if e.probe_id in by_id else e
        for e in base.unexplained
        if e.probe_id not in ctx.explained
    )
    return Classification(
        diagnoses=tuple(diagnoses), explanations=tuple(explanations), unexplained=unexplained
    )


__all__ = [
    "RULES",
    "ParallelContext",
    "ParallelRule",
    "classify_parallel",
    "describe_outcome",
    "device_never_set",
    "followers",
    "invalid_routing_under_ep",
    "number",
]
