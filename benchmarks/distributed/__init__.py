"""Across ranks and engines: veRL's FSDP engine with and without dualkv (its ray stub), and FSDP2 / sequence
parallelism through examples/fsdp_grpo.py (fsdp_sp.sh, NGPUS GPUs)."""
