"""Deliberately faulty grouped GEMMs, one per cause: they calibrate the doctor.

Each module exposes ``moe_grouped_gemm(x, w, m_sizes, *, out_dtype=None)``, is a small diff from
``qmoe_doctor.kernels.grouped_gemm`` (the changed lines carry a ``# PLANTED:`` comment), is right
in the benign condition and wrong only under the condition its docstring names. The registry
(names, cause ids, kernel refs) is pure data in ``qmoe_doctor.core.specimens``; this package imports
no specimen on import, so listing them never loads torch or triton.
"""
