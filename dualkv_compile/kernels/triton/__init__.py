"""The hand-written Triton kernels of shared-prompt attention.

    attention.py   the launcher: supports, config_for, Config, KernelConfig, forward, backward, DQ_MODES
    schedule.py    per-launch tile schedules and the ancestor walk from ``Segments`` (no device sync)
    tma.py         Hopper tensor descriptors over the operands, where the strides allow
    launch.py      the compile options every launch passes (FMA contraction, as the kernels were tuned)
    tiles.py       the jitted tile loads shared by the kernels
    fwd.py, bwd.py the forward and backward kernels

Importing the package imports no kernel module; ``TRITON_INTERPRET`` must be
set before ``fwd.py`` / ``bwd.py`` are first imported for the CPU interpreter.
"""
