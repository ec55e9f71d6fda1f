"""Which part of the packed backward loses float32 precision on a prompt shared by thousands of rows (issue 35, defect 5).

The measurement of ``tests/test_shared_token_precision.py`` (the embedding gradient at the prompt's tokens, relative to
float64 truth, against the uncompiled float32 model's) for each inner compiler and attention backend, so a failing
CUDA run says whether the loss comes from the attention kernel, from Inductor's code or from the unpack gather.
Each row names the backend that ran the attention; a graph that dualkv refused (run unpacked: the uncompiled model's
own sums) says so instead of an error ratio. ``--head-dim`` sets the model's head dim: 8 (the test's reference
cases) is below the Triton kernels' 16, where ``auto`` falls back to the reference backend on CUDA.

    python benchmarks/probes/shared_token_precision.py --device cuda --rows 4096 --head-dim 32 --backends auto,triton,reference
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import dualkv_compile  # noqa: E402
from benchmarks import harness  # noqa: E402
from tests.helpers import grpo_batch, hf_model  # noqa: E402
from tests.test_shared_token_precision import _embedding_grad, dualkv_embedding_grad  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--inners", default="inductor,aot_eager")
    ap.add_argument("--backends", default="auto")
    ap.add_argument("--head-dim", type=int, default=8, choices=(8, 16, 32), help="the model's head dim (the kernels need 16 or more)")
    args = ap.parse_args(argv)
    ids, mask, pos = (t.to(args.device) for t in grpo_batch([(2, [2] * args.rows)], vocab=101, left_pad=0, right_pad=0))
    model = hf_model("qwen3", "sdpa", layers=1, head_dim=args.head_dim).to(args.device)
    truth = _embedding_grad(copy.deepcopy(model).double(), ids, mask, pos)
    prompt = ids[0, :2].unique()

    def err(g):
        return ((g[prompt].double() - truth[prompt]).norm() / truth[prompt].norm()).item()

    e_plain = err(_embedding_grad(model, ids, mask, pos))
    print("\n".join(harness.markdown_stamp(harness.stamp("shared_token_precision", device=args.device,
                                                          script=__file__, argv=argv))))
    print(f"rows {args.rows}, head dim {args.head_dim}, {args.device}, torch {torch.__version__}: "
          f"plain float32 error {e_plain:.3e}", flush=True)
    for inner in args.inners.split(","):
        for backend in args.backends.split(","):
            head = f"  inner {inner:9s} attention {backend:9s}"
            t0 = time.time()
            try:
                g, ran, refusals = dualkv_embedding_grad(model, ids, mask, pos, {"inner": inner, "attention_backend": backend})
                if refusals:  # the unpacked model ran: its error is no measure of dualkv
                    print(f"{head}: refused: ran unpacked ({refusals[0][:160]})", flush=True)
                    continue
                e = err(g)
                print(f"{head}: ran {','.join(sorted(ran)):9s} error {e:.3e} ({e / e_plain:.2f}x plain) "
                      f"[{time.time() - t0:.0f} s]", flush=True)
            except Exception as exc:  # noqa: BLE001  (a backend that does not run here is reported, not fatal)
                print(f"{head}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
