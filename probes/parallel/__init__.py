"""Parallel modes of the MoE block (child side; imports torch): data, pipeline, tensor and expert
parallelism, each rank checked against a single-device run of the same weights and inputs.

``python -m qmoe_doctor.probes.parallel.rank --spec SPEC.json --out DIR`` is one rank, started by
``torch.distributed.run`` for dp, tp and ep, or alone for pp and the one-device baseline. On the
parent side ``qmoe_doctor.plan.parallel`` plans one launch per mode, ``qmoe_doctor.isolate.torchrun``
starts it and reads every rank's files back, ``qmoe_doctor.diagnose.parallel_rules`` classifies the
ranks, and ``qmoe_doctor.workflows.parallel`` runs those steps into a report; docs/parallel.md
describes the modes, the files a run writes and the multi-node command.

* ``hooks``: the rank-level seams a kernel module may override (set-device, expert id remap);
* ``ep``: expert-parallel dispatch arithmetic (pure functions) and the all-to-all autograd op;
* ``ep_gather``: the gather dispatch (every token to every rank, pushes that overlap the experts);
* ``tp``: tensor-parallel sharding (pure functions) and the copy / reduce autograd ops;
* ``modes``: the runners, one per mode (the ep block's ``QMOE_EP_*`` variables are read through
  ``qmoe_doctor.core.knobs``); ``rank``: the entry point and its record keeping.
"""
