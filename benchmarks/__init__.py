"""The benchmarks of dualkv_compile, a package of groups (benchmarks/README.md): each script runs as
``python benchmarks/<group>/<script>.py`` from the repository root, and imports its siblings as ``benchmarks.<group>.<module>``."""
