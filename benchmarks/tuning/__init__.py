"""Launch configs of the kernels: the Triton sweep, the Gluon sweep and its picker, the compile-only resource report."""
