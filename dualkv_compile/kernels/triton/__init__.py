"""The hand-written Triton kernels of shared-prompt attention (what they share with Gluon: ``kernels/common``).

    attention.py   the launcher: supports, forward, backward (and configs.py's names)
    configs.py     the tuning tables: config_for, Config, KernelConfig, DQ_MODES, HOPPER_CONFIGS
    windows.py     sliding / chunked windows: the plans that bound each tile's blocks (over common/schedule.py)
    tma.py         Triton's tensor descriptors over the operands, where the strides allow (common/tma.py)
    tiles.py       the jitted tile loads and window bounds shared by the kernels
    fwd.py         the forward kernel
    bwd.py         the backward's dK/dV kernel (after common/row_statistics.py's preprocess); bwd_dq.py its dQ kernel

Importing the package imports no kernel module; ``TRITON_INTERPRET`` must be
set before ``fwd.py`` / ``bwd.py`` / ``bwd_dq.py`` are first imported for the CPU interpreter.
"""
