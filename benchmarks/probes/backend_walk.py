"""A graph's walk through ``dualkv_backend``: the files its pipeline visits, in order, and how often it goes back.

``walk(fn, *args)`` compiles ``fn`` with the dualkv backend, and for each backend call (a Dynamo graph) records the
package functions entered within ``depth`` calls below ``dualkv_backend`` (the pipeline's stages and their direct
helpers), in call order, by file. Consecutive calls in one file are one **stop**. A stop is a **return** when its
file was visited before in the walk, and a **climb** when its file's pipeline stage comes before the previous
stop's (``STAGES``: normalize -> analysis -> rewrite -> plan -> runtime; graph/, layout/, ops/, kernels/ and the
rest are no stage: a call into them never climbs). So a climb is a later stage reaching back into an earlier one,
which the plan floor exists to prevent (issue 50's count: at most 3 climbs and 45 stops for a packed graph).

    python benchmarks/probes/backend_walk.py            # the tiny Qwen3 GRPO loss through @policy_loss
    python benchmarks/probes/backend_walk.py --depth 3

Assumes the package's files live under ``dualkv_compile/`` (the probe keys stops by path). Guarantees: one walk per
backend call, the first one that rewrote a graph printed in full; compile work below ``depth`` (per-node rules,
Inductor) is not in it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
PACKAGE = os.path.join(ROOT, "dualkv_compile") + os.sep
STAGES = ("normalize", "analysis", "rewrite", "plan", "runtime")


@dataclasses.dataclass
class Walk:
    stops: list[str]  # files, relative to the package, one per stop

    @property
    def files(self) -> int:
        return len(set(self.stops))

    @property
    def returns(self) -> int:
        return sum(f in self.stops[:i] for i, f in enumerate(self.stops))

    @property
    def climbs(self) -> int:
        stage = [_stage(f) for f in self.stops]
        last, n = None, 0
        for s in stage:
            if s is None:
                continue
            n += last is not None and s < last
            last = s
        return n

    def summary(self) -> str:
        return f"{len(self.stops)} stops in {self.files} files ({self.returns} returns, {self.climbs} climbs)"


def _stage(path: str):
    top = path.split("/")[0]
    return STAGES.index(top) if top in STAGES else None


def walk(fn, *args, depth: int = 2, backend_options=None) -> list[Walk]:
    """One ``Walk`` per backend call made while compiling and running ``fn(*args)`` once."""
    from dualkv_compile import backend as backend_module

    walks: list[Walk] = []
    original = backend_module.dualkv_backend
    entry = original.__code__

    def traced(gm, example_inputs, **kw):
        files: list[str] = []
        level = [0]

        def profile(frame, event, _arg):
            if event == "call":
                level[0] += 1
                path = frame.f_code.co_filename
                if frame.f_code is not entry and path.startswith(PACKAGE) and 1 < level[0] <= depth + 1:
                    rel = path[len(PACKAGE):].replace(os.sep, "/")
                    if not files or files[-1] != rel:
                        files.append(rel)
            elif event == "return":
                level[0] -= 1

        old = sys.getprofile()
        sys.setprofile(profile)
        try:
            return original(gm, example_inputs, **kw)
        finally:
            sys.setprofile(old)
            walks.append(Walk([f for f in files if f != "backend.py"] or files))

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=functools.partial(traced, options=dict(backend_options or {"inner": "aot_eager"})))
    compiled(*args)
    return walks


def tiny_grpo():
    """The tiny Qwen3 and GRPO loss of the tests (``@policy_loss``'s form, compiled whole): (fn, args)."""
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_cache=False,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    prompt, lengths = torch.randint(1, 128, (12,)), [3, 5, 4, 2]
    ids = torch.zeros(4, 12 + max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(lengths):
        ids[row, :12], ids[row, 12:12 + r], mask[row, :12 + r] = prompt, torch.randint(1, 128, (r,)), 1

    def loss(input_ids, attention_mask):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        return (logp * attention_mask[:, 1:]).sum()

    return loss, (ids, mask)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=2, help="calls below dualkv_backend to follow (default 2)")
    args = ap.parse_args(argv)
    fn, inputs = tiny_grpo()
    for i, w in enumerate(walk(fn, *inputs, depth=args.depth)):
        print(f"graph {i}: {w.summary()}")
        print("  " + " -> ".join(w.stops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
