import sys, time, torch, cProfile, pstats
ROOT = __import__("os").path.abspath(__file__ + "/../../../.."); sys.path.insert(0, ROOT); sys.path.insert(0, ROOT + "/benchmarks")
import dualkv_compile
from dualkv_compile.rewrite.packed_inputs import PackedInputs
from peers_sides import make_batch
torch.set_num_threads(1)
b = make_batch(2, 8, 1024, 512, True, 151936, "cpu")
def step():
    lay = dualkv_compile.detect(b["input_ids"], b["attention_mask"], None, vocab_size=151936, same_columns=False)
    PackedInputs.of(lay)
    return lay
for _ in range(3): step()
ts = []
for _ in range(10):
    t = time.perf_counter(); lay = step(); ts.append(time.perf_counter() - t)
print(f"detect+PackedInputs.of on [16, 1536]: median {sorted(ts)[5]*1e3:.1f} ms; {lay.stats()}")
pr = cProfile.Profile(); pr.enable(); step(); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(18)
