"""qmoe-doctor: diagnose multi-GPU memory faults in fused Mixture-of-Experts kernels.

The parent side (this package, except the ``kernels`` and ``probes`` subpackages) never
imports torch or triton: a CUDA fault poisons the process that made it, and the parent
must survive every probe.
"""

__version__ = "0.1.0"
