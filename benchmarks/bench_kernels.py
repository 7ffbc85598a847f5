"""Side-by-side throughput of our MoE kernels and the alternatives, in one run.

    python -m benchmarks.bench_kernels                       # qwen3-30b-a3b gate_up, M=16384, bf16
    python -m benchmarks.bench_kernels --preset qwen3-235b-a22b --m 8192 --json-out bench.json
    python -m benchmarks.bench_kernels --tokens 512,2048,8192 --plot bench.png
    python -m benchmarks.bench_kernels --tiny                # CPU, Triton interpreter: a smoke run

A thin wrapper: the measuring code is ``qmoe_doctor.probes.bench`` (installed with the package),
the same code ``qmoe-doctor bench`` runs in a child process; here it runs in this process on the
current CUDA device. Rows, for forward (y = x @ w[e].T), dx (dy @ w[e]) and dw (dy_e.T @ x_e):
``qmoe`` (ours), ``torch._grouped_mm``, the ``per-expert loop``, and ``dense (same FLOPs)``, one
cuBLAS GEMM of the same FLOPs (the ceiling); and for the whole Qwen3-MoE block (forward, and
forward + backward): ``MoEBlock`` on our kernels, with ``torch._grouped_mm`` as its forward
kernel, and the per-expert-loop twin.

TFLOP/s count 2*M*N*K FLOP per GEMM (6*M*H*I for the block forward, 3x that with backward) over
the median time of ``triton.testing.do_bench``. Every row also gives its relative error against
a float32 reference (float64 on the CPU). ``--tiny`` runs on the CPU under TRITON_INTERPRET=1 to
show that the script works: it times nothing and claims nothing about speed. The JSON
(``--json-out``) is the ``bench`` report of ``qmoe-doctor bench --json``.
"""

from __future__ import annotations

from qmoe_doctor.probes.bench import script_main

if __name__ == "__main__":
    raise SystemExit(script_main())
