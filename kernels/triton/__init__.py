"""Triton kernels for CUDA devices, one module per op family.

Every public function here has the signature and semantics of the torch reference it replaces
(``kernels/*.py``), so ``kernels.backends.triton_ops()`` can swap them in one by one. Importing this package
imports ``triton``; the CPU path never does. Tests run these kernels on the CPU under ``TRITON_INTERPRET=1``
(set before import).
"""
