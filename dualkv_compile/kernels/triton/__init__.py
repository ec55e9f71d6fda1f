"""The hand-written Triton kernels of shared-prompt attention.

    attention.py   the launcher: supports, forward, backward (and configs.py's names)
    configs.py     the tuning tables: config_for, Config, KernelConfig, DQ_MODES, HOPPER_CONFIGS
    schedule.py    per-launch tile schedules and the ancestor walk from ``Segments`` (no device sync)
    window_rule.py the window rule on token depth (host tensor ops), below schedule.py and windows.py
    windows.py     sliding / chunked windows: the plans that bound each tile's blocks (over schedule.py)
    tma.py         Hopper tensor descriptors over the operands, where the strides allow
    launch.py      the compile options every launch passes (FMA contraction, as the kernels were tuned)
    tiles.py       the jitted tile loads and window bounds shared by the kernels
    fwd.py         the forward kernel
    bwd.py         the backward's preprocess and dK/dV kernels; bwd_dq.py its dQ kernel

Importing the package imports no kernel module; ``TRITON_INTERPRET`` must be
set before ``fwd.py`` / ``bwd.py`` / ``bwd_dq.py`` are first imported for the CPU interpreter.
"""
