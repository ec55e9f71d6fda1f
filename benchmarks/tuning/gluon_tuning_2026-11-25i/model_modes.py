"""One whole-model row (argv: N,P,R; modes, comma-separated; the model, default 0.6b) with the Gluon dK/dV config's dQ mode forced to recompute, then "auto" (dev only)."""
import os
import sys
sys.path.insert(0, "benchmarks")
import model_gpu  # noqa: E402
from dualkv_compile.kernels.gluon import attention as ga  # noqa: E402

out = os.environ["OUT"]
shape = sys.argv[1]
model = sys.argv[3] if len(sys.argv) > 3 else "0.6b"
for mode in sys.argv[2].split(","):
    ga.DKDV_CONFIGS[128] = ga.DkdvConfig(dq_mode=mode)
    print(f"=== dq_mode {mode}", flush=True)
    model_gpu.main(["--models", model, "--shapes", shape, "--variants", "dualkv", "--budget-s", "240",
                    "--out", os.path.join(out, f"model_{model}_{mode}")])
