"""Device code of the public ops: the ``@triton.jit`` and Gluon kernels, each launched by the
host code of one public module (``grouped_gemm`` -> ``grouped_gemm_kernels``, ``backward`` ->
``backward_kernels``, ``combine`` -> ``combine_kernels``, ``dw_overlap`` ->
``dw_overlap_kernels``, ``dw_ws`` -> ``dw_ws_kernels``).

Kernel parameters have no Python type: they are Triton values (pointers, scalars, tensor
descriptors), and Triton reads parameter annotations to specialize a kernel (``tl.constexpr``),
so they stay unannotated. pyproject's mypy override relaxes the untyped-definition checks for
this package only; the host code (checks, config choice, launchers) stays in the public modules
under ``mypy --strict``.
"""
