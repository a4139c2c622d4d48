#!/usr/bin/env python3
"""A dsa adapter whose lightning indexer is the layer's own q and k projections (an experiment, not a recipe):
indexer heads 0 .. G-1 take W_q's rows of the query heads of KV head g, the shared indexer key W_k's rows of KV
head g, head weights 1/G (head G .. H_I-1 weighted 0); the gate is the source adapter's. The indexer then scores a
position with sum_j ReLU(q_j . k_s) of the teacher's logits without RoPE.

    make_adapter.py MODEL.gguf SOURCE_DSA_ADAPTER.gguf GROUPS OUT.gguf

GROUPS: one KV head for every layer (e.g. 0), or LAYER=G,... for those layers alone (the others become softmax);
a group of -1 keeps the source's indexer.
"""
import sys

import numpy as np
import gguf

model, src, groups, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
per_layer = dict((int(a), int(b)) for a, b in (x.split("=") for x in groups.split(","))) if "=" in groups else None
mr = gguf.GGUFReader(model)
ar = gguf.GGUFReader(src)
f = {k: v for k, v in ar.fields.items()}


def scalar(r, k):
    v = r.fields[k]
    return v.parts[v.data[0]][0]


H, Hk = int(scalar(ar, "still.base.head_count")), int(scalar(ar, "still.base.head_count_kv"))
d = int(scalar(ar, "still.base.embedding_length"))
D = d // H
HI = int(ar.fields["still.attn.layer_index_heads"].parts[ar.fields["still.attn.layer_index_heads"].data[0]][0])
dI = int(ar.fields["still.attn.layer_index_dim"].parts[ar.fields["still.attn.layer_index_dim"].data[0]][0])
G = H // Hk
assert dI == D and HI >= G, (dI, D, HI, G)
mt = {t.name: t for t in mr.tensors}


def weight(name):
    t = mt[name]
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(w, dtype=np.float32).reshape(-1, d)


w = gguf.GGUFWriter(out, "still-adapter")
for k, v in ar.fields.items():
    if k.startswith("GGUF.") or k == "general.architecture":
        continue
    vt = v.types[0]
    if per_layer is not None and k == "still.attn.layer_kinds":
        n = len(v.data)
        w.add_array(k, ["dsa" if l in per_layer else "softmax" for l in range(n)])
        continue
    if per_layer is not None and k in ("still.attn.layer_index_heads", "still.attn.layer_index_dim",
                                       "still.attn.layer_topk"):
        vals = [v.parts[i][0].item() for i in v.data]
        w.add_array(k, [x if l in per_layer else 0 for l, x in enumerate(vals)])
        continue
    if vt == gguf.GGUFValueType.ARRAY:
        et = v.types[1]
        vals = [v.parts[i] for i in v.data]
        vals = [bytes(x).decode() for x in vals] if et == gguf.GGUFValueType.STRING else [x[0].item() for x in vals]
        w.add_array(k, vals) if et != gguf.GGUFValueType.STRING else w.add_array(k, vals)
    elif vt == gguf.GGUFValueType.STRING:
        w.add_string(k, bytes(v.parts[v.data[0]]).decode())
    else:
        w.add_key_value(k, v.parts[v.data[0]][0].item(), vt)
for t in ar.tensors:
    p = np.array(t.data, dtype=np.float32).copy()
    l = int(t.name.split(".")[1])
    if per_layer is not None and l not in per_layer:
        continue
    group = per_layer[l] if per_layer is not None else int(groups)
    if group < 0:   # the source's trained indexer, as it is
        w.add_tensor(t.name, p)
        continue
    wq, wk = weight(f"blk.{l}.attn_q.weight"), weight(f"blk.{l}.attn_k.weight")
    at = 0
    WqI = p[at:at + HI * dI * d].reshape(HI * dI, d); at += HI * dI * d
    WkI = p[at:at + dI * d].reshape(dI, d); at += dI * d
    Ww = p[at:at + HI * d].reshape(HI, d); at += HI * d
    bw = p[at:at + HI]
    WqI[:] = 0
    for j in range(G):
        h = group * G + j
        WqI[j * dI:(j + 1) * dI] = wq[h * D:(h + 1) * D]
    WkI[:] = wk[group * D:(group + 1) * D]
    Ww[:] = 0
    bw[:] = 0
    bw[:G] = 1.0 / G
    w.add_tensor(t.name, p)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(f"wrote {out}: indexers = W_q, W_k of KV heads {groups}")
