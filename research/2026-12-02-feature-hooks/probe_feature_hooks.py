"""Probe: what transformers' output-capturing hooks cost a one-token forward, against hooks on the wanted layers only.

Two copies of the default target (SmolLM2-135M-Instruct, fp32, exact kernels, 2 threads): `a` never asked for
`output_hidden_states`; `b` did once, which leaves transformers' capturing hooks on every decoder layer and
attention module. Interleaved one-token forwards on a chat prompt's cache, medians of 75: `a` plain, `a` with five
forward hooks of our own (what `dspark_hf._transformers.recording_layers` does), `b` plain, `b` asking for the
five layers' hidden states (what the engine and speculative generate() did before).

    python research/2026-12-02-feature-hooks/probe_feature_hooks.py
"""

import statistics
import time

import torch
from transformers import DynamicCache

from dspark_hf._transformers import hidden_states_request, selected_hidden_states
from dspark_hf.default_model import chat_inputs, load_default_target
from dspark_hf import kernels

torch.set_num_threads(2)
a, tok = load_default_target()
b, _ = load_default_target()
ids = chat_inputs(tok, "Why is the sky blue?")["input_ids"]
lids = [1, 8, 14, 20, 27]
with torch.inference_mode():
    b(ids, output_hidden_states=hidden_states_request(lids))  # installs transformers' capturing hooks on b
print(
    "hooks on b layers:",
    sum(len(layer._forward_hooks) for layer in b.model.layers),
    "a:",
    sum(len(layer._forward_hooks) for layer in a.model.layers),
)


def own(model):
    store = {}
    hs = [
        model.model.layers[i].register_forward_hook(
            lambda m, args, out, i=i: store.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in lids
    ]
    return store, hs


with torch.inference_mode(), kernels.use_kernels(a, b, mode="exact"):
    ca = DynamicCache(config=a.config)
    a(ids, cache=ca, use_cache=True)
    cb = DynamicCache(config=b.config)
    b(ids, cache=cb, use_cache=True)
    new = ids[:, -1:]
    res = {k: [] for k in ("a plain", "a own hooks", "b plain", "b capture")}
    for _ in range(80):
        for k in res:
            m, c = (a, ca) if k[0] == "a" else (b, cb)
            kw = {"output_hidden_states": hidden_states_request(lids)} if k == "b capture" else {}
            s = time.perf_counter()
            if k == "a own hooks":
                store, hs = own(a)
                out = m(new, cache=c, use_cache=True)
                f = torch.cat([store[i] for i in lids], -1)
                for h in hs:
                    h.remove()
            else:
                out = m(new, cache=c, use_cache=True, **kw)
                if k == "b capture":
                    f = selected_hidden_states(out.hidden_states, lids)
            res[k].append(time.perf_counter() - s)
            c.crop(-1)
    for k, v in res.items():
        print(k, round(statistics.median(v[5:]) * 1e3, 2), "ms")
