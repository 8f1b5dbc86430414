"""Writes ``gpt2_tiny_hf.safetensors``: a tiny random GPT-2 made by HuggingFace's ``transformers`` (float64, eager
attention, its parameters moved off the initialization), with an input and the logits ``GPT2LMHeadModel`` gives for it
(keys ``__input_ids``, ``__logits``). ``tests/test_gpt2.py`` checks `sharpness.GPT2` against them. Needs
``transformers`` (not a dependency of this project): ``python tests/data/make_gpt2_tiny_hf.py OUT.safetensors``.
"""

import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
cfg = GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=23, n_positions=8, attn_implementation="eager",
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
m = GPT2LMHeadModel(cfg).double().eval()
with torch.no_grad():
    for p in m.parameters():
        p.add_(0.3 * torch.randn_like(p))  # LayerNorm scales and biases off 1 and 0, larger weights
sd = {k: v.contiguous() for k, v in m.state_dict().items() if k != "lm_head.weight"}
ids = torch.randint(0, 23, (3, 8))
with torch.no_grad():
    logits = m(input_ids=ids).logits
sd["__input_ids"] = ids
sd["__logits"] = logits
generator = f"transformers {transformers.__version__} GPT2LMHeadModel, eager attention, float64"
save_file(sd, sys.argv[1], metadata={"generator": generator, "n_head": "2"})
print(logits.shape, float(logits.abs().max()))
