"""Parallel modes of the MoE block (child side; imports torch): data, pipeline, tensor and expert
parallelism, each rank checked against a single-device run of the same weights and inputs.

``python -m qmoe_doctor.probes.parallel.rank --spec SPEC.json --out DIR`` is one rank, started by
``torch.distributed.run`` for dp, tp and ep, or alone for pp and the one-device baseline. The
parent (``qmoe_doctor.workflows.parallel``) plans, launches, collects and classifies; docs/parallel.md
describes the modes, the files a run writes and the multi-node command.

* ``hooks``: the rank-level seams a kernel module may override (set-device, expert id remap);
* ``ep``: expert-parallel dispatch arithmetic (pure functions) and the all-to-all autograd op;
* ``tp``: tensor-parallel sharding (pure functions) and the copy / reduce autograd ops;
* ``modes``: the runners, one per mode; ``rank``: the entry point and its record keeping.
"""
