"""HAND-WRITTEN FORMAT SAMPLES of compute-sanitizer records we have not recorded yet.

Written by us from the shape of each record kind (a header line with one space after the nine
'=', continuation lines indented further; the wording of each header as the parser's patterns in
qmoe_doctor/diagnose/sanitizer_log.py describe it). Kernel names, files, addresses and counts are made up.
They exercise the parser's branches; they are not recordings and say nothing about what the
tool really prints. Replace each with a recording under tests/fixtures/sanitizer/<recording>/
once one exists (racecheck with hazards, initcheck, synccheck, an API error, --xml --save).
"""

from __future__ import annotations

RACE_SAMPLE = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at tile_kernel+0x1a0 in tile.py:40
=========     and Read access at tile_kernel+0x2b0 in tile.py:52 [128 hazards]
=========     and Read access at tile_kernel+0x2c0 in tile.py:53 [64 hazards]
=========
========= Warning: Race reported between Read access at tile_kernel+0x300 in tile.py:60
=========     and Write access at tile_kernel+0x310 in tile.py:61 [2 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""

API_SAMPLE = """\
========= COMPUTE-SANITIZER
========= Program hit cudaErrorLaunchFailure (error 719) due to "unspecified launch failure" on CUDA API call to cudaEventSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: cudaEventSynchronize [0x1234] in libcudart.so.13
=========
========= ERROR SUMMARY: 1 error
"""

INITCHECK_SAMPLE = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at consume_kernel+0x150 in consume.py:12
=========     by thread (3,0,0) in block (0,0,0)
=========     Address 0x7f0000000400
=========
========= Host API memory access error at host access to 0x7f0000001000 of size 64 bytes
=========     Uninitialized access at 0x7f0000001000 on access by cudaMemcpy source.
=========
========= ERROR SUMMARY: 2 errors
"""

LEGACY_SAMPLE = """\
========= CUDA-MEMCHECK
========= Invalid __global__ read of size 4
=========     at 0x000002e8 in inner_step(double*, int)
=========     by thread (7,0,0) in block (2,0,0)
=========     Address 0x7f0000000004 is out of bounds
=========     Device Frame:outer_kernel(double*, int) (outer_kernel(double*, int) : 0xa0)
=========     Saved host backtrace up to driver entry point at kernel launch time
=========     Host Frame:/usr/lib64/libcuda.so.1 (cuLaunchKernel + 0x2b8) [0x222dd8]
=========     Host Frame:./app [0x1f00]
=========
========= ERROR SUMMARY: 1 error
"""

NOTES_SAMPLE = """\
========= COMPUTE-SANITIZER
========= Warning: hand-written tool note (the parser keeps such lines as notes)
========= Barrier error detected (hand-written top-level line of a kind the parser does not know)
=========     at sync_kernel+0x40 in sync.py:9
========= ERROR SUMMARY: 1 error
"""
