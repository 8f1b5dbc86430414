"""Writes ``electra_tiny_hf.safetensors`` and its ``config.json`` (``electra_tiny_hf.json``): a tiny random
``ElectraForSequenceClassification`` made by HuggingFace's ``transformers`` (float64, eager attention, parameters
moved off the initialization; embeddings of width 8 widened to blocks of width 16 by ``embeddings_project``, as in
ELECTRA-small, 2 blocks with 2 heads, 3 classes), with two inputs and the logits the model gives for them:
``__input_ids`` (N, T) alone, and ``__pairs`` (N, 3, T): ids, token types and an attention mask with padding at the
end, as a tokenizer returns sentence pairs (``__logits``, ``__pair_logits``). ``tests/test_electra.py`` checks
`sharpness.Electra` against them. Needs ``transformers`` (not a dependency of this project):
``python tests/data/make_electra_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import ElectraConfig, ElectraForSequenceClassification

torch.manual_seed(0)
cfg = ElectraConfig(vocab_size=31, embedding_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=24, max_position_embeddings=12, type_vocab_size=2, num_labels=3,
                    layer_norm_eps=1e-5, attn_implementation="eager")  # fmt: skip
m = ElectraForSequenceClassification(cfg).double().eval()
with torch.no_grad():
    for p in m.parameters():
        p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights
sd = {k: v.contiguous() for k, v in m.state_dict().items()}
ids = torch.randint(0, 31, (4, 9))
lengths = torch.tensor([9, 6, 4, 7])  # tokens before the padding
mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
types = ((torch.arange(9)[None, :] >= torch.tensor([5, 3, 2, 9])[:, None]) & (mask == 1)).long()  # second sentences
pads = ids.masked_fill(mask == 0, 0)
with torch.no_grad():
    logits = m(input_ids=ids).logits
    pair_logits = m(input_ids=pads, token_type_ids=types, attention_mask=mask).logits
sd["__input_ids"], sd["__logits"] = ids, logits
sd["__pairs"], sd["__pair_logits"] = torch.stack((pads, types, mask), dim=1), pair_logits
generator = f"transformers {transformers.__version__} ElectraForSequenceClassification, eager attention, float64"
out = Path(sys.argv[1])
save_file(sd, str(out / "electra_tiny_hf.safetensors"), metadata={"generator": generator})
cfg.to_json_file(str(out / "electra_tiny_hf.json"))
print(tuple(logits.shape), float(logits.abs().max()), float(pair_logits.abs().max()))
