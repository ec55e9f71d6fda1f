"""Write ablated copies of kernels/gluon/dkdv.py (timing only; results wrong) into tree copies (dev only).
usage: python ablate.py SRC_TREE DST_ROOT  -> DST_ROOT/{a1,a2,a3}"""
import os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
P = "dualkv_compile/kernels/gluon/dkdv.py"
text = open(os.path.join(src, P)).read()
ADD = "        _add_dq(dq * sm_scale, dq_desc, dq_stage, dq_row, dq_col, m, limit, MASK, BLOCK_M, dq_zero.shape[1])\n"
WFULL = "        mbarrier.wait(ds_full.index(buf), bph)\n"
WEMPTY = "        mbarrier.wait(ds_empty.index(buf), bph ^ 1)\n"
assert ADD in text and WFULL in text and WEMPTY in text
variants = {
    "a1": text.replace(ADD, "        dq_stage.store(dq * sm_scale)\n"),
    "a2": text.replace(WFULL, "").replace(WEMPTY, ""),
}
variants["a3"] = variants["a1"].replace(WFULL, "").replace(WEMPTY, "")
for name, t in variants.items():
    d = os.path.join(dst, name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d, symlinks=True)
    open(os.path.join(d, P), "w").write(t)
    print("wrote", d)
