"""Where the dualkv runner's per-call host syncs come from (outside the compiled packed graph)."""
import sys, collections, traceback, argparse, time
import torch
torch.set_num_threads(1)
ROOT = __import__("os").path.abspath(__file__ + "/../../../.."); sys.path.insert(0, ROOT); sys.path.insert(0, ROOT + "/benchmarks")
import dualkv_compile, model_moe
from peers_sides import SIDES, make_batch
from dualkv_compile.runtime import runner as R
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

ap = argparse.ArgumentParser(); ap.add_argument("--moe", type=int, default=1); ap.add_argument("--prompt", type=int, default=128)
ap.add_argument("--response", type=int, default=64); a = ap.parse_args()

class Syncs(TorchDispatchMode):
    def __init__(self): super().__init__(); self.where = collections.Counter(); self.ops = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.is_nonzero.default) or "item" in str(func):
            st = [f for f in traceback.extract_stack() if "dualkv_compile" in f.filename]
            self.where[(str(func), " < ".join(f"{f.filename.split('dualkv_compile/')[1]}:{f.lineno}:{f.name}" for f in st[::-1][:3]))] += 1
        return func(*args, **(kwargs or {}))

orig_call = R.Runner.__call__
modes = []
def call(self, *args):
    if not hasattr(self, "_wrapped") and self.compiled is not None:
        inner = self.compiled
        def run(*xs):
            with _disable_current_modes():
                return inner(*xs)
        self.compiled, self._wrapped = run, True
    if self.compiled is None or self.report.packed_calls < 2:
        return orig_call(self, *args)
    m = Syncs(); modes.append(m)
    with m:
        t = time.perf_counter(); out = orig_call(self, *args); m.t = time.perf_counter() - t
    return out
R.Runner.__call__ = call

from transformers import Qwen3MoeForCausalLM, Qwen3ForCausalLM, Qwen3Config
torch.manual_seed(0)
if a.moe:
    cfg = model_moe.moe_config("30b-a3b", 4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32, vocab_size=2048, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(cfg).train()
else:
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=2048, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, num_hidden_layers=4, use_cache=False, tie_word_embeddings=False, attn_implementation="sdpa")).train()
batch = make_batch(2, 8, a.prompt, a.response, True, 2048, "cpu")
args = argparse.Namespace(compile=True, inner="inductor", device="cpu", rollouts=8, standin="sdpa")
side = SIDES["dualkv"](model, batch, args)
for i in range(4):
    model.zero_grad(set_to_none=True); side.loss(model, batch).backward()
m = modes[-1]
print(f"moe={a.moe}: runner calls {len(modes)}; last call: {sum(m.ops.values())} aten ops outside the packed graph, "
      f"host syncs {sum(v for (f, _), v in m.where.items() if 'nonzero' not in f or 'is_' in f)}, runner wall (CPU) {m.t*1e3:.1f} ms incl. packed fwd")
for k, v in sorted(m.where.items(), key=lambda kv: -kv[1]): print(f"  {v:3d} {k[0]:40s} {k[1]}")
print("  ops:", m.ops.most_common(25))
r = dualkv_compile.reports()[-1]; print("  report:", r.graph_id, r.rewritten, r.packed_calls, r.packed_compiles, r.fallback_reasons[-1:])
