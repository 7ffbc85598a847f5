"""Facts about this host, learnt without creating a CUDA context.

    inventory.py   GPUs from NVML: topology, P2P, CUDA ordinal <-> nvidia-smi index, GPU selection
    sanitizer.py   the compute-sanitizer binary: where it is, which version, its command line
    xid.py         Xid events from the kernel log and NVML while a run goes on

Imports ``core`` only. Only the isolation layer and the workflows read it (an import contract).
"""
