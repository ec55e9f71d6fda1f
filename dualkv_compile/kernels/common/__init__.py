"""What the Triton and Gluon attention kernels share, arch-neutral: both backends import it, neither the other.

    launch.py          LAUNCH_OPTIONS (the compile options every launch passes), block_d, check_launch (the limits)
    schedule.py        per-launch tile schedules and the ancestor walk from ``Segments`` (no device sync), cached
    window_rule.py     the window rule on token depth (host tensor ops), below schedule.py and triton/windows.py
    tma.py             tma_geometry: the 2-D view of an operand a tensor descriptor needs, where the strides allow
    row_statistics.py  the backward's preprocess kernel: Delta = rowsum(dO * O) and the packed row statistics

Importing the package imports no kernel module; ``row_statistics.py`` defines a Triton kernel, so the launchers
import it where they launch it (``TRITON_INTERPRET`` must be set before its first import for the interpreter).
"""
