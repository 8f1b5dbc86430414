"""Writes ``distilbert_tiny_hf.safetensors`` and its ``config.json`` (``distilbert_tiny_hf.json``): a tiny random
``DistilBertForSequenceClassification`` made by HuggingFace's ``transformers`` (float64, eager attention, parameters
moved off the initialization; 2 blocks of width 16 with 2 heads, an MLP of 24, 3 classes), with two inputs and the
logits the model gives for them: ``__input_ids`` (N, T) alone, and ``__masked`` (N, 2, T): ids and an attention mask
with padding at the end, as DistilBERT's tokenizer returns them (``__logits``, ``__masked_logits``).
``tests/test_distilbert.py`` checks `sharpness.DistilBert` against them. Needs ``transformers`` (not a dependency of
this project): ``python tests/data/make_distilbert_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import DistilBertConfig, DistilBertForSequenceClassification

torch.manual_seed(0)
cfg = DistilBertConfig(vocab_size=31, dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_position_embeddings=12,
                       num_labels=3, attn_implementation="eager")  # fmt: skip
m = DistilBertForSequenceClassification(cfg).double().eval()
with torch.no_grad():
    for p in m.parameters():
        p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights
sd = {k: v.contiguous() for k, v in m.state_dict().items()}
ids = torch.randint(0, 31, (4, 9))
lengths = torch.tensor([9, 6, 4, 7])  # tokens before the padding
mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
pads = ids.masked_fill(mask == 0, 0)
with torch.no_grad():
    logits = m(input_ids=ids).logits
    masked_logits = m(input_ids=pads, attention_mask=mask).logits
sd["__input_ids"], sd["__logits"] = ids, logits
sd["__masked"], sd["__masked_logits"] = torch.stack((pads, mask), dim=1), masked_logits
generator = f"transformers {transformers.__version__} DistilBertForSequenceClassification, eager attention, float64"
out = Path(sys.argv[1])
save_file(sd, str(out / "distilbert_tiny_hf.safetensors"), metadata={"generator": generator})
cfg.to_json_file(str(out / "distilbert_tiny_hf.json"))
print(tuple(logits.shape), float(logits.abs().max()), float(masked_logits.abs().max()))
