"""The parallel modes (``qmoe-doctor parallel``): their names and the conditions their ranks run.

=====  ======================================================  ==================================
mode   how                                                     launched as
=====  ======================================================  ==================================
dp     DistributedDataParallel, gradients all-reduced          torchrun, one rank per GPU
tp     gate_up by columns, down by rows, outputs all-reduced   torchrun, one rank per GPU
ep     experts sharded, tokens dispatched by all-to-all        torchrun, one rank per GPU
pp     layers over the GPUs of one process (device_map)        one process, no torchrun
single the block on one GPU: the tokens/s baseline             one process, no torchrun
=====  ======================================================  ==================================

Vocabulary the planner, the rules, the reports and the renderers share (stdlib only).
"""

from __future__ import annotations

from collections.abc import Mapping

from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.records import Condition


class Mode(StrEnum):
    SINGLE = "single"  # the one-device baseline
    DP = "dp"
    PP = "pp"
    TP = "tp"
    EP = "ep"


CONDITION_OF: Mapping[Mode, Condition] = {
    Mode.SINGLE: Condition.PARALLEL_SINGLE,
    Mode.DP: Condition.PARALLEL_DP,
    Mode.PP: Condition.PARALLEL_PP,
    Mode.TP: Condition.PARALLEL_TP,
    Mode.EP: Condition.PARALLEL_EP,
}
MODE_OF: Mapping[Condition, Mode] = {c: m for m, c in CONDITION_OF.items()}
#: Modes that run one process per GPU under torchrun (the others run in one process).
TORCHRUN_MODES = frozenset({Mode.DP, Mode.TP, Mode.EP})
#: The modes a user can ask for, in their default order.
USER_MODES = (Mode.DP, Mode.PP, Mode.TP, Mode.EP)

__all__ = ["CONDITION_OF", "MODE_OF", "TORCHRUN_MODES", "USER_MODES", "Mode"]
