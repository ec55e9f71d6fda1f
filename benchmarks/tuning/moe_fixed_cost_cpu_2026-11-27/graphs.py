"""ATen op counts of the forward/backward graphs Inductor compiles, per side (reduced qwen3-30b-a3b shape, CPU)."""
import sys, collections, argparse
import torch
torch.set_num_threads(1)
ROOT = __import__("os").path.abspath(__file__ + "/../../../.."); sys.path.insert(0, ROOT); sys.path.insert(0, ROOT + "/benchmarks")
import dualkv_compile, model_moe
from peers_sides import SIDES, make_batch
import torch._inductor.compile_fx as cfx
ap = argparse.ArgumentParser(); ap.add_argument("--sides", default="plain_varlen,dualkv"); ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--dtype", default="float32")
a = ap.parse_args()
seen = []
import torch._inductor.config as icfg
from torch._inductor.custom_graph_pass import CustomGraphPass
class Spy(CustomGraphPass):
    def __call__(self, g):
        c = collections.Counter(str(n.target) for n in g.nodes if n.op == "call_function")
        seen.append((None, len(g.nodes), c))
    def uuid(self): return None
icfg.fx_graph_cache = False
icfg.post_grad_custom_pre_pass = Spy()
from transformers import Qwen3MoeForCausalLM
torch.manual_seed(0)
cfg = model_moe.moe_config("30b-a3b", a.layers, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           num_experts=128, num_experts_per_tok=8, moe_intermediate_size=32, vocab_size=2048, tie_word_embeddings=False)
model = Qwen3MoeForCausalLM(cfg).to(getattr(torch, a.dtype)).train()
batch = make_batch(2, 8, 128, 64, True, 2048, "cpu")
args = argparse.Namespace(compile=True, inner="inductor", device="cpu", rollouts=8, standin="sdpa")
res = {}
import varlen_attention
def _blockdiag(q, k, v, cu, scale):
    """Traceable CPU stand-in for the varlen kernel: one SDPA per layer with a block-diagonal causal mask."""
    T = q.shape[0]; t = torch.arange(T)
    seg = torch.searchsorted(cu[1:].long(), t, right=True)
    m = (seg[:, None] == seg[None, :]) & (t[None, :] <= t[:, None])
    rep = q.shape[1] // k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=m, scale=scale)
    return o.transpose(0, 1)
varlen_attention._varlen_loop = _blockdiag
for name in a.sides.split(","):
    torch._dynamo.reset(); seen.clear()
    side = SIDES[name](model, batch, args)
    model.config._attn_implementation = side.attn
    for _ in range(3):
        model.zero_grad(set_to_none=True); side.loss(model, batch).backward()
    model.config._attn_implementation = "sdpa"
    tot = collections.Counter()
    for bw, n, c in seen: tot.update(c)
    res[name] = tot
    print(f"== {name}: {len(seen)} graphs compiled, nodes {[n for _, n, _ in seen]}, call_function total {sum(tot.values())}")
keys = sorted(set().union(*res.values()), key=lambda k: -max(r[k] for r in res.values()))
print("op".ljust(60), *[s[:14].rjust(14) for s in res])
for k in keys:
    vals = [res[s][k] for s in res]
    if len(set(vals)) > 1 or max(vals) >= 8: print(k[:60].ljust(60), *[str(v).rjust(14) for v in vals])
