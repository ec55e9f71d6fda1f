"""Whole-model GRPO steps: dualkv against Inductor or the strongest baseline, on CPU and GPU, dense, MoE, the
remove-padding row, this year's attention variants, TRL's trainer; the A/B and memory tools around model_cpu.py."""
