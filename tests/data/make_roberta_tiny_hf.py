"""Writes ``roberta_tiny_hf.safetensors`` and its ``config.json`` (``roberta_tiny_hf.json``): a tiny random
``RobertaForSequenceClassification`` made by HuggingFace's ``transformers`` (float64, eager attention, parameters moved
off the initialization; 2 blocks of width 16 with 2 heads, 3 classes, padding id 1, a position table of 12 rows, so
sequences of at most 10 tokens), with two inputs and the logits the model gives for them: ``__input_ids`` (N, T) alone
(the padding id 1 also inside sequences, which moves the positions after it), and ``__pairs`` (N, 3, T): ids, token
types (all 0: RoBERTa has one) and an attention mask, with padding (id 1) at the end, as a tokenizer returns them
(``__logits``, ``__pair_logits``). ``tests/test_roberta.py`` checks `sharpness.Roberta` against them. Needs
``transformers`` (not a dependency of this project): ``python tests/data/make_roberta_tiny_hf.py OUT_DIR``.
"""

import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import RobertaConfig, RobertaForSequenceClassification

torch.manual_seed(0)
cfg = RobertaConfig(
    vocab_size=31,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=24,
    max_position_embeddings=12,
    type_vocab_size=1,
    num_labels=3,
    layer_norm_eps=1e-5,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    attn_implementation="eager",
)
m = RobertaForSequenceClassification(cfg).double().eval()
with torch.no_grad():
    for p in m.parameters():
        p.add_(0.3 * torch.randn_like(p))  # LayerNorm weights off 1, larger weights, padding rows not zero
sd = {k: v.contiguous() for k, v in m.state_dict().items()}
ids = torch.randint(2, 31, (4, 9))
ids[:, 0] = 0  # <s>
ids[1, 4] = ids[3, 2] = 1  # the padding id inside a sequence: the positions after it shift
lengths = torch.tensor([9, 6, 4, 7])  # tokens before the padding
mask = (torch.arange(9)[None, :] < lengths[:, None]).long()
pads = torch.where(mask == 1, ids.clamp(min=2), 1)
pads[:, 0] = 0
types = torch.zeros_like(ids)
with torch.no_grad():
    logits = m(input_ids=ids).logits
    pair_logits = m(input_ids=pads, token_type_ids=types, attention_mask=mask).logits
sd["__input_ids"], sd["__logits"] = ids, logits
sd["__pairs"], sd["__pair_logits"] = torch.stack((pads, types, mask), dim=1), pair_logits
generator = f"transformers {transformers.__version__} RobertaForSequenceClassification, eager attention, float64"
out = Path(sys.argv[1])
save_file(sd, str(out / "roberta_tiny_hf.safetensors"), metadata={"generator": generator})
cfg.to_json_file(str(out / "roberta_tiny_hf.json"))
print(tuple(logits.shape), float(logits.abs().max()), float(pair_logits.abs().max()), sorted(sd)[:3])
