"""`sharpness.from_transformers`: a transformers model object read into the toolkit's twin of its family, through its
``config.to_dict()`` and ``state_dict()`` alone. Checked on stand-ins holding the fixtures transformers wrote (the
twin's logits against transformers' own), on refusals (a base model, an unknown type, no config), and, where
transformers is installed, on its own objects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from sharpness import GPT2, DistilBert, Electra, Llama, Roberta, from_transformers

DATA = Path(__file__).parent / "data"


class _Config:
    def __init__(self, settings: dict):
        self.settings = settings

    def to_dict(self) -> dict:
        return dict(self.settings)


def _stand_in(name: str, settings: dict, state: dict) -> nn.Module:
    """A module of class ``name`` with ``config`` and ``state_dict()``, as a transformers object has them."""
    model = type(name, (nn.Module,), {})()
    model.config = _Config(settings)
    model.state_dict = lambda: dict(state)
    return model


def _fixture(stem: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
    state = load_file(str(DATA / f"{stem}.safetensors"))
    return state, state.pop("__input_ids"), state.pop("__logits")


@pytest.mark.parametrize(
    "stem, name",
    [
        ("qwen3_tiny_hf", "Qwen3ForCausalLM"),
        ("olmo2_tiny_hf", "Olmo2ForCausalLM"),
        ("phi3_tiny_hf", "Phi3ForCausalLM"),
        ("qwen2_tiny_hf", "Qwen2ForCausalLM"),
        ("gemma_tiny_hf", "GemmaForCausalLM"),
        ("gemma2_tiny_hf", "Gemma2ForCausalLM"),
        ("gemma3_tiny_hf", "Gemma3ForCausalLM"),
    ],
)
def test_a_causal_lm_becomes_a_llama_with_its_logits(stem, name):
    state, ids, logits = _fixture(stem)
    settings = json.loads((DATA / f"{stem}.json").read_text())
    twin = from_transformers(_stand_in(name, settings, state))
    assert isinstance(twin, Llama) and not twin.training
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=1e-5)  # transformers' RMSNorm: float32
        across = from_transformers(_stand_in(name, settings, state), classes_last=False)(ids)
        torch.testing.assert_close(across, logits.transpose(1, 2), rtol=0, atol=1e-5)
    assert set(dict(twin.named_parameters())) <= set(state) | {"lm_head.weight"}  # transformers' names


def test_gpt2_s_lm_head_model_becomes_a_gpt2():
    state, ids, logits = _fixture("gpt2_tiny_hf")
    twin = from_transformers(_stand_in("GPT2LMHeadModel", {"model_type": "gpt2", "n_head": 2}, state))
    assert isinstance(twin, GPT2)
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name, kind", [("RobertaForSequenceClassification", "roberta"),
                                        ("XLMRobertaForSequenceClassification", "xlm-roberta"),
                                        ("CamembertForSequenceClassification", "camembert")])  # fmt: skip
def test_roberta_s_sequence_classifiers_become_a_roberta(name, kind):
    """RoBERTa's, XLM-RoBERTa's and CamemBERT's classifiers are one function under the same keys."""
    state = load_file(str(DATA / "roberta_tiny_hf.safetensors"))
    ids, logits = state.pop("__input_ids"), state.pop("__logits")
    pairs, pair_logits = state.pop("__pairs"), state.pop("__pair_logits")
    settings = {**json.loads((DATA / "roberta_tiny_hf.json").read_text()), "model_type": kind}
    twin = from_transformers(_stand_in(name, settings, state))
    assert isinstance(twin, Roberta) and not twin.training
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(twin(pairs), pair_logits, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=rf"reads \*{name.removesuffix('SequenceClassification')}"):
        from_transformers(_stand_in(name.replace("Sequence", "Token"), settings, state))


def test_electra_s_sequence_classifier_becomes_an_electra():
    state = load_file(str(DATA / "electra_tiny_hf.safetensors"))
    pairs, pair_logits = state.pop("__pairs"), state.pop("__pair_logits")
    state.pop("__input_ids"), state.pop("__logits")
    settings = json.loads((DATA / "electra_tiny_hf.json").read_text())
    twin = from_transformers(_stand_in("ElectraForSequenceClassification", settings, state))
    assert isinstance(twin, Electra) and not twin.training
    with torch.no_grad():
        torch.testing.assert_close(twin(pairs), pair_logits, rtol=0, atol=1e-12)


def test_distilbert_s_sequence_classifier_becomes_a_distilbert():
    state = load_file(str(DATA / "distilbert_tiny_hf.safetensors"))
    ids, logits = state.pop("__input_ids"), state.pop("__logits")
    masked, masked_logits = state.pop("__masked"), state.pop("__masked_logits")
    settings = json.loads((DATA / "distilbert_tiny_hf.json").read_text())
    twin = from_transformers(_stand_in("DistilBertForSequenceClassification", settings, state))
    assert isinstance(twin, DistilBert) and not twin.training
    with torch.no_grad():
        torch.testing.assert_close(twin(ids), logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(twin(masked), masked_logits, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"reads \*DistilBertForSequenceClassification"):
        from_transformers(_stand_in("DistilBertForMaskedLM", settings, state))


@pytest.mark.parametrize("model, error, fragment", [
    (lambda s: _stand_in("Qwen3Model", {"model_type": "qwen3"}, s), ValueError, "reads *ForCausalLM"),
    (lambda s: _stand_in("T5ForConditionalGeneration", {"model_type": "t5"}, s), ValueError, "model type 't5'"),
    (lambda s: nn.Linear(2, 2), TypeError, "expects a transformers model object"),
    (lambda s: _stand_in("Qwen3ForCausalLM", {"model_type": "qwen3"}, {k: v.to("meta") for k, v in s.items()}),
     ValueError, "on the meta device"),
    (lambda s: _stand_in("Qwen3ForCausalLM", {"model_type": "qwen3", "num_attention_heads": 3}, s), ValueError,
     "not a positive multiple of the head size"),
])  # fmt: skip
def test_what_has_no_twin_is_refused_in_one_sentence(model, error, fragment):
    state, _, _ = _fixture("qwen3_tiny_hf")
    with pytest.raises(error, match=fragment.replace("*", r"\*")):
        from_transformers(model(state))


# transformers' own models, built from a config (transformers is passed in: it is imported only where installed)
OWN = {
    "qwen3": lambda t: t.Qwen3ForCausalLM(t.Qwen3Config(
        vocab_size=31, hidden_size=16, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32, attn_implementation="eager")),
    # the norm weights moved off 0 (below), so that Gemma's 1 + w matters; soft caps bend the scores and logits
    "gemma2": lambda t: t.Gemma2ForCausalLM(t.Gemma2Config(
        vocab_size=31, hidden_size=16, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
        max_position_embeddings=32, attn_implementation="eager")),
    # OPT-350m's layout: LayerNorms after the sums, embeddings projected in and out
    "opt": lambda t: t.OPTForCausalLM(t.OPTConfig(
        vocab_size=31, hidden_size=16, ffn_dim=20, num_hidden_layers=2, num_attention_heads=2, word_embed_proj_dim=12,
        do_layer_norm_before=False, max_position_embeddings=32, attn_implementation="eager")),
    # phi-2's layout with query/key LayerNorms and one key/value head
    "phi": lambda t: t.PhiForCausalLM(t.PhiConfig(
        vocab_size=31, hidden_size=16, intermediate_size=20, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, qk_layernorm=True, max_position_embeddings=32, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # GPT-J's layout with a quarter of each head's features turned in interleaved pairs
    "gptj": lambda t: t.GPTJForCausalLM(t.GPTJConfig(
        vocab_size=31, n_embd=32, n_layer=2, n_head=2, rotary_dim=4, n_inner=20, n_positions=32,
        attn_implementation="eager")),
    # RoBERTa's classifier: positions numbered from the padding id (1), which the random ids also hold
    "roberta": lambda t: t.RobertaForSequenceClassification(t.RobertaConfig(
        vocab_size=31, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=20,
        max_position_embeddings=12, type_vocab_size=1, num_labels=3, layer_norm_eps=1e-5, pad_token_id=1,
        attn_implementation="eager")),
    "electra": lambda t: t.ElectraForSequenceClassification(t.ElectraConfig(
        vocab_size=31, embedding_size=8, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=20, max_position_embeddings=12, num_labels=3, attn_implementation="eager")),
    "distilbert": lambda t: t.DistilBertForSequenceClassification(t.DistilBertConfig(
        vocab_size=31, dim=16, n_layers=2, n_heads=2, hidden_dim=20, max_position_embeddings=12, num_labels=3,
        attn_implementation="eager")),
}  # fmt: skip


@pytest.mark.parametrize("kind", OWN)
def test_transformers_own_objects_where_it_is_installed(kind):
    """transformers' own causal LMs and encoder classifiers (float64, weights moved off their
    initialization): the twin's logits are theirs (to transformers' float32 softmax)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = OWN[kind](transformers).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 31, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(from_transformers(model)(ids), model(ids).logits, rtol=0, atol=1e-5)
