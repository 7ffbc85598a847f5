"""Run one probe in this process, for evidence gathering under compute-sanitizer.

    python3 tools/evidence/run_probe.py '<ProbeSpec JSON>'          # outcome JSON on stdout
    python3 tools/evidence/run_probe.py --raw '<ProbeSpec JSON>'    # no catching: Python's own traceback

``--raw`` lets the exception escape so the recorded traceback is exactly what a user sees.
"""

from __future__ import annotations

import sys

from qmoe_doctor.core.records import ProbeSpec, from_json, to_json
from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.worker import execute


def main(argv: list[str]) -> int:
    raw = "--raw" in argv
    args = [a for a in argv if a != "--raw"]
    spec = from_json(ProbeSpec, args[0])
    if raw:
        from qmoe_doctor.probes.conditions import run_probe, sync_all

        fields = run_probe(ProbeContext(spec))
        sync_all()
        print({k: str(v) for k, v in fields.items()})
        return 0
    outcome, _ = execute(spec)
    print(to_json(outcome))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
