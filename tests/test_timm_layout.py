"""Vision transformers laid out as timm writes them (``tests/timm_like.py``, checked against logits timm 1.0.31 itself
wrote: ``tests/data/make_timm_vit_tiny.py``): the placeholders timm leaves for optional layers (``nn.Identity``),
dropout layers between the pooled features and the head, a forward taking ``attn_mask=None, is_causal=False``, and
timm's own ``LayerNorm`` subclass. Before, the first three cost the value/output factors, the LayerNorm trades and the
R-operator products, and a normalization subclass was an unknown operation; here the group is the one of
`sharpness.HFViT` (per head GL(h) on query/key and value/output, every LayerNorm traded), checked with elements built
by hand, against the dense quotient Hessian and the dense Hessian; subclasses that compute something else stay
unknown.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_transformer_quotient import _with as _moved
from test_transformer_quotient import dense_quotient_spectrum, measure_value
from timm_like import VisionTransformer
from torch import nn

import manifolds
from manifolds._same_forward import read_as
from sharpness import Objective, TimmViT, euclidean_sharpness
from sharpness._cli import main as sharpness_main
from sharpness._specs import SpecError
from sharpness.products._reference import dense_hessian

DATA = Path(__file__).parent / "data"
FIXTURES = {"timm_vit_tiny": {}, "timm_vit_tiny_ls_avg": {"init_values": 0.5, "global_pool": "avg"},
            "timm_vit_tiny_qknorm": {"qk_norm": True}}
LABELS = torch.tensor([0, 3, 9, 3, 1])
WIDTH, HEADS, HD, DEPTH = 16, 2, 8, 2


def _fixture(name: str):
    state = load_file(str(DATA / f"{name}.safetensors"))
    images, logits = state.pop("__images"), state.pop("__logits")
    model = VisionTransformer(**FIXTURES[name]).double().eval()
    model.load_state_dict(state)
    return model, images, logits


def _small(norm: type[nn.Module] = nn.LayerNorm, seed: int = 0, **options) -> tuple[nn.Module, torch.Tensor]:
    """A ViT of 1 block, width 8, 2 heads, on 4x4 images in 2x2 patches (about 1,000 parameters: the dense references
    are cheap), its parameters moved off the initialization, and its LayerNorms of class ``norm``."""
    torch.manual_seed(seed)
    model = VisionTransformer(image=4, patch=2, classes=3, dim=8, depth=1, heads=2, **options).double()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.LayerNorm and norm is not nn.LayerNorm:
                setattr(parent, name, norm(child.normalized_shape[0], eps=child.eps).double())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval(), torch.randn(5, 1, 4, 4, dtype=torch.float64)


def _hand_element(model: VisionTransformer, g: torch.Generator) -> dict:
    """Per head ``A`` on the query/key rows of ``qkv`` and ``B`` on its value rows and the columns of ``proj``; every
    LayerNorm's scale ``c`` traded against the columns of the layer reading it (``qkv``, ``fc1``, the head); every
    LayerScale ``gamma`` times ``c`` against the rows and bias of the layer it scales (``proj``, ``fc2``) over ``c``.
    With ``qk_norm`` the query/key ``A`` is no symmetry: ``q_norm``'s scale and shift times ``c``, ``k_norm``'s over
    ``c`` instead."""
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    dim, heads = model.head.in_features, model.blocks[0].attn.num_heads
    hd = dim // heads

    def gl():
        return torch.eye(hd, dtype=torch.float64) + 0.5 * torch.randn(hd, hd, generator=g, dtype=torch.float64)

    def trade(norm: str, readers: list[str]):
        c = torch.exp(0.7 * torch.randn(dim, generator=g, dtype=torch.float64))
        sd[f"{norm}.weight"], sd[f"{norm}.bias"] = sd[f"{norm}.weight"] * c, sd[f"{norm}.bias"] * c
        for r in readers:
            sd[f"{r}.weight"] = sd[f"{r}.weight"] / c

    for i in range(len(model.blocks)):
        p = f"blocks.{i}."
        normed = f"{p}attn.q_norm.weight" in sd
        if normed:
            c = torch.exp(0.7 * torch.randn(hd, generator=g, dtype=torch.float64))
            for t in ("weight", "bias"):
                sd[f"{p}attn.q_norm.{t}"], sd[f"{p}attn.k_norm.{t}"] = (sd[f"{p}attn.q_norm.{t}"] * c,
                                                                        sd[f"{p}attn.k_norm.{t}"] / c)  # fmt: skip
        for h in range(heads):
            a, b = torch.eye(hd, dtype=torch.float64) if normed else gl(), gl()
            for role, m in enumerate((a.T, torch.linalg.inv(a), b.T)):
                rows = slice(role * dim + h * hd, role * dim + (h + 1) * hd)
                for t in ("weight", "bias"):
                    sd[f"{p}attn.qkv.{t}"][rows] = m @ sd[f"{p}attn.qkv.{t}"][rows]
            cols = slice(h * hd, (h + 1) * hd)
            sd[f"{p}attn.proj.weight"][:, cols] = sd[f"{p}attn.proj.weight"][:, cols] @ torch.linalg.inv(b).T
        trade(p + "norm1", [p + "attn.qkv"])
        trade(p + "norm2", [p + "mlp.fc1"])
        for scale, layer in (("ls1", "attn.proj"), ("ls2", "mlp.fc2")):
            if f"{p}{scale}.gamma" in sd:
                c = torch.exp(0.7 * torch.randn(dim, generator=g, dtype=torch.float64))
                sd[f"{p}{scale}.gamma"] = sd[f"{p}{scale}.gamma"] * c
                sd[f"{p}{layer}.weight"] = sd[f"{p}{layer}.weight"] / c[:, None]
                sd[f"{p}{layer}.bias"] = sd[f"{p}{layer}.bias"] / c
    trade("fc_norm" if model.global_pool == "avg" else "norm", ["head"])
    return sd


@pytest.mark.parametrize("name", FIXTURES)
def test_the_layout_computes_timm_s_logits(name):
    model, images, logits = _fixture(name)
    with torch.no_grad():
        assert (model(images) - logits).abs().max() <= 1e-12


@pytest.mark.parametrize("name", FIXTURES)
def test_the_group_is_every_head_and_every_layernorm_and_hand_built_elements_keep_the_logits(name):
    model, images, _ = _fixture(name)
    sym = manifolds.transformer_symmetry(model, images)
    kinds = [f.kind for f in sym.factors]
    scales = 2 * DEPTH if "init_values" in FIXTURES[name] else 0  # LayerScales
    normed = DEPTH if "qk_norm" in FIXTURES[name] else 0  # query/key normalizations traded for the query/key GL
    diagonal = 2 * DEPTH + 1 + scales + normed  # and the LayerNorms
    assert kinds.count("GL") == DEPTH * HEADS * (2 - bool(normed)) and kinds.count("diagonal") == diagonal, \
        sym.describe()  # fmt: skip
    assert sym.dim == DEPTH * HEADS * (2 - bool(normed)) * HD * HD + (2 * DEPTH + 1 + scales) * WIDTH + normed * HD
    assert "head.weight" in {b.name for f in sym.factors for b in f.blocks}  # through x[:, 0] or the mean, and dropout
    fresh = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    for twin in (_moved(model, _hand_element(model, g)), sym.transformed(model, sym.random_element(1.0, g))):
        with torch.no_grad():
            assert (twin(fresh) - model(fresh)).abs().max() < 1e-10


@pytest.mark.parametrize("name", FIXTURES)
def test_the_invariant_measure_is_unchanged_by_a_hand_built_element_and_euclidean_sharpness_moves(name):
    model, images, _ = _fixture(name)
    loss, data = nn.CrossEntropyLoss(), (images, LABELS)
    moved = _moved(model, _hand_element(model, torch.Generator().manual_seed(3)))
    before, after = float(measure_value(model, loss, data)[0]), float(measure_value(moved, loss, data)[0])
    assert abs(after - before) <= 1e-8 * abs(before), (before, after)
    e0 = euclidean_sharpness(model, loss, data, dtype=torch.float64, progress=False).value
    e1 = euclidean_sharpness(moved, loss, data, dtype=torch.float64, progress=False).value
    assert max(e0, e1) / min(e0, e1) > 1.5, (e0, e1)


@pytest.mark.parametrize("options", [{}, {"init_values": 0.5, "global_pool": "avg"}, {"qk_norm": True}])
def test_the_measure_equals_the_dense_quotient_reference_and_products_the_dense_hessian(options):
    model, x = _small(**options)
    loss, data = nn.CrossEntropyLoss(), (x, torch.tensor([0, 1, 2, 1, 0]))
    sym = manifolds.transformer_symmetry(model, x)
    # per head GL(4) on query/key (none with qk_norm: its scales, 4) and value/output; 3 LayerNorms, 2 LayerScales
    expected = HEADS * 2 * 4 * 4 + (5 if "init_values" in options else 3) * 8
    assert sym.dim == (expected - HEADS * 4 * 4 + 4 if "qk_norm" in options else expected), sym.describe()
    params = {n: p.detach() for n, p in model.named_parameters()}
    reference = dense_quotient_spectrum(model, loss, data, manifolds.symmetry_metric(sym, params), sym)
    assert np.allclose(measure_value(model, loss, data, k=2), reference[::-1][:2], rtol=1e-8, atol=0)
    obj = Objective(model, loss, data)
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref = dense_hessian(obj) @ v
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-11 * float(ref.abs().max()))


# -- LayerNorm subclasses: read as nn.LayerNorm only where their forward is its forward ---------------------------
class KernelChoice(nn.LayerNorm):
    """timm's ``LayerNorm``: a forward of its own that calls ``F.layer_norm`` as ``nn.LayerNorm`` does, unless a
    faster kernel is chosen."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps=eps)
        self.fast = False

    def forward(self, x):
        if self.fast:
            return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Shifted(nn.LayerNorm):
    """Gemma's scale: ``(1 + weight)``, a scale that a trade of ``weight`` alone does not move by ``c``."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, 1 + self.weight, self.bias, self.eps)


class Inherited(nn.LayerNorm):
    pass


def test_read_as_compares_the_forward_s_graph_exactly():
    class OtherEps(nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, 2 * self.eps)

    class Branching(nn.LayerNorm):  # fx cannot trace a branch on the data
        def forward(self, x):
            return super().forward(x) if bool(x.sum() > 0) else x

    class Constant(nn.LayerNorm):  # a tensor argument: not compared by value, not accepted
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, torch.ones(self.normalized_shape), self.bias, self.eps)

    class NoGradient(nn.LayerNorm):  # the stock graph: fx does not record grad mode
        def forward(self, x):
            with torch.no_grad():
                return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    class NoGradientCall(nn.LayerNorm):  # the stock forward, called without gradients
        def __call__(self, *args, **kwargs):
            with torch.no_grad():
                return super().__call__(*args, **kwargs)

    assert read_as(KernelChoice(4)) is nn.LayerNorm and read_as(Inherited(4)) is nn.LayerNorm
    assert read_as(nn.LayerNorm(4)) is nn.LayerNorm and read_as(nn.Linear(2, 2)) is nn.Linear
    for kind in (Shifted, OtherEps, Branching, Constant, NoGradient, NoGradientCall):
        assert read_as(kind(4)) is kind
    fast = KernelChoice(4)
    fast.fast = True  # the other branch: another computation (a float32 round trip)
    assert read_as(fast) is KernelChoice


@pytest.mark.parametrize("norm", [KernelChoice, Shifted])
def test_a_layernorm_subclass_is_traded_and_read_only_where_it_computes_layernorm(norm):
    model, x = _small(norm)
    sym = manifolds.transformer_symmetry(model, x)
    diagonal = [f for f in sym.factors if f.kind == "diagonal"]
    assert len([f for f in sym.factors if f.kind == "GL"]) == HEADS * 2
    assert len(diagonal) == (3 if norm is KernelChoice else 0), sym.describe()
    loss, data = nn.CrossEntropyLoss(), (x, torch.tensor([0, 1, 2, 1, 0]))
    obj = Objective(model, loss, data)
    assert obj.hvp_strategy() == ("rop" if norm is KernelChoice else "graph")
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref = dense_hessian(obj) @ v
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-11 * float(ref.abs().max()))
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(6)))
    with torch.no_grad():
        assert (moved(x) - model(x)).abs().max() < 1e-10


@pytest.mark.parametrize("norm", [nn.LayerNorm, KernelChoice, Shifted])
def test_the_rescaling_rules_read_a_layernorm_subclass_as_layernorm_only_where_it_is_one(norm):
    """A LayerNorm between ReLUs: its affine output scales pass the ReLU to the last layer's columns (6 free scales,
    checked by hand), for ``nn.LayerNorm`` and a subclass computing it; none for another computation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), norm(6), nn.ReLU(), nn.Linear(6, 2)).double().eval()
    x = torch.randn(5, 4, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    assert sym.dim == (0 if norm is Shifted else 6), sym.describe()
    c = torch.exp(torch.randn(6, generator=torch.Generator().manual_seed(9), dtype=torch.float64))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[2].weight.mul_(c), twin[2].bias.mul_(c), twin[4].weight.div_(c)
        moved = float((twin(x) - model(x)).abs().max())
    assert moved < 1e-12 if norm is not Shifted else moved > 1e-3  # Gemma's (1 + weight) is not traded so


# -- the trace: arguments at their defaults, identity placeholders ----------------------------------------------
class Optional(nn.Module):
    """A forward with arguments beyond the input, each with a default (timm's ``attn_mask=None, is_causal=False``)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
        self.skip = nn.Identity()

    def forward(self, x, mask=None, scale: float = 2.0, causal=False):
        if mask is not None or causal:  # a placeholder would take this branch while fx traces
            x = x.masked_fill(mask, 0.0)
        return self.b(torch.relu(self.skip(self.a(x)))) * scale


def test_the_graph_is_traced_for_model_x_with_the_other_arguments_at_their_defaults():
    model, x = Optional().double().eval(), torch.randn(5, 4, dtype=torch.float64)
    traced = manifolds.trace_network(model, x)
    assert traced.failure is None, traced.failure
    nodes = list(traced.graph.nodes)
    assert [n.op for n in nodes].count("placeholder") == 1
    assert not any(n.op == "call_module" and n.target == "skip" for n in nodes)  # the placeholder layer: no node
    assert "masked_fill" not in {str(n.target) for n in nodes}
    assert manifolds.transformer_symmetry(model, x).dim == 6  # the hidden ReLU units, as without the extra arguments
    obj = Objective(model, nn.MSELoss(), (x, torch.randn(5, 2, dtype=torch.float64)))
    assert obj.hvp_strategy() == "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ref = dense_hessian(obj) @ v
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


def test_an_identity_with_a_hook_stays_a_call_and_its_hook_runs():
    model, x = Optional().double().eval(), torch.randn(5, 4, dtype=torch.float64)
    model.skip.register_forward_hook(lambda module, args, out: 3 * out)
    traced = manifolds.trace_network(model, x)
    assert traced.failure is None, traced.failure
    assert any(n.op == "call_module" and n.target == "skip" for n in traced.graph.nodes)
    obj = Objective(model, nn.MSELoss(), (x, torch.randn(5, 2, dtype=torch.float64)))
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    ref = dense_hessian(obj) @ v
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


# -- sharpness.TimmViT: timm's checkpoints without timm ------------------------------------------------------------
LAYOUTS = {"timm_vit_tiny": "token", "timm_vit_tiny_ls_avg": "avg", "timm_deit_tiny_distilled": "token",
           "timm_vit_tiny_reg_gap": "avg", "timm_vit_tiny_qknorm": "token", "timm_vit_tiny_map": "map",
           "timm_vit_tiny_map_prefix": "map"}  # fmt: skip


def _checkpoint(name: str):
    state = load_file(str(DATA / f"{name}.safetensors"))
    return state, state.pop("__images"), state.pop("__logits")


@pytest.mark.parametrize("name", LAYOUTS)
def test_timmvit_computes_timm_s_logits_and_has_the_whole_group(name):
    """A class token and final LayerNorm; LayerScale and the mean through fc_norm; DeiT's distillation token and
    second head; registers, positions for the patches alone and the mean after the final LayerNorm (pool=avg); each
    head's query and key normalized (qk_norm: their scales traded instead of the query/key GL); attention pooling by a
    latent query (map, SigLIP's: the pool's query/key and value/output GL per head and its LayerNorm traded too),
    also of the tokens after a class token and registers, which timm's pooling leaves out (before, they were read:
    logits 0.2 to 0.8 off)."""
    state, images, logits = _checkpoint(name)
    model = TimmViT.from_state_dict(state, heads=HEADS, pool=LAYOUTS[name])
    with torch.no_grad():
        assert (model(images) - logits).abs().max() <= 1e-12
    sym = manifolds.transformer_symmetry(model, images)
    scales = 2 * DEPTH if "_ls" in name else 0  # LayerScale on both branches of every block
    gl = DEPTH * HEADS * (1 if "qknorm" in name else 2) * HD * HD
    normed = DEPTH * HD if "qknorm" in name else 0
    pool = HEADS * 2 * HD * HD + WIDTH if "_map" in name else 0  # the pool's factors and its MLP's LayerNorm
    assert sym.dim == gl + (2 * DEPTH + 1 + scales) * WIDTH + normed + pool, sym.describe()
    moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(10)))
    with torch.no_grad():
        assert (moved(images) - model(images)).abs().max() < 1e-10
    assert Objective(model, nn.CrossEntropyLoss(), (images, LABELS)).hvp_strategy() == "rop"


def test_timmvit_refuses_what_does_not_fit_with_the_reason():
    state, _, _ = _checkpoint("timm_vit_tiny")
    headless = {k: v for k, v in state.items() if not k.startswith("head.")}
    cases = {
        "no classifier": (headless, "no 2-axis tensor head.weight"),
        "qk_norm": ({**state, "blocks.0.attn.q_norm.weight": torch.ones(HD)}, "missing ['blocks.0.attn.k_norm.bias'"),
        "attention pooling read as a token": ({**state, "attn_pool.latent": torch.zeros(1, 1, WIDTH)},
                                              "only a model pooling by attention has (this one has them)"),
        "heads": (state, "dim=16 is not a multiple of heads=3"),
        "positions": ({**state, "pos_embed": torch.zeros(1, 19, WIDTH)}, "not one square grid"),
        "registers": ({**state, "reg_token": torch.zeros(WIDTH)}, "reg_token has shape (16,), not (1, k, width)"),
    }
    with pytest.raises(SpecError, match="give pool=token or pool=avg or pool=map"):  # max: the keys of an average
        TimmViT.from_state_dict(state, heads=HEADS, pool="max")
    with pytest.raises(SpecError, match="only a model pooling by attention has"):
        TimmViT.from_state_dict(state, heads=HEADS, pool="map")
    pooled, _, _ = _checkpoint("timm_vit_tiny_map")
    with pytest.raises(SpecError, match=re.escape("TimmViT reads one latent query")):
        TimmViT.from_state_dict({**pooled, "attn_pool.latent": torch.zeros(1, 2, WIDTH)}, heads=HEADS, pool="map")
    for what, (bad, message) in cases.items():
        with pytest.raises(SpecError, match=re.escape(message)):
            TimmViT.from_state_dict(bad, heads=3 if what == "heads" else HEADS, pool="token")


def test_the_command_line_measures_a_timm_checkpoint(tmp_path, capsys):
    state, images, _ = _checkpoint("timm_vit_tiny")
    save_file(state, str(tmp_path / "vit.safetensors"))
    np.savez(tmp_path / "images.npz", X=images.numpy(), y=LABELS.numpy())
    out = tmp_path / "r.json"
    argv = ["compute", "--model", "timmvit:heads=2,pool=token", "--checkpoint", str(tmp_path / "vit.safetensors"),
            "--data", str(tmp_path / "images.npz"), "--metric", "symmetry", "--quiet", "--json", str(out)]  # fmt: skip
    assert sharpness_main(argv) == 0
    model = TimmViT.from_state_dict(state, heads=HEADS, pool="token")
    expected = measure_value(model, nn.CrossEntropyLoss(), (images, LABELS))
    assert json.loads(out.read_text())["measures"]["symmetry"]["value"] == pytest.approx(float(expected[0]), rel=1e-6)
    np.savez(tmp_path / "wide.npz", X=images.reshape(5, 1, 4, 16).numpy(), y=LABELS.numpy())  # as many patches
    cases = (
        ("timmvit:heads=2", "images.npz", "and how it pools the tokens (global_pool: token, avg or map)"),
        ("timmvit:heads=2,pool=token", "wide.npz", "the model takes images (N, 1, 8, 8)"),
    )
    for model, data, message in cases:
        bad = argv[:-2]
        bad[bad.index("--model") + 1], bad[bad.index("--data") + 1] = model, str(tmp_path / data)
        assert sharpness_main(bad) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_a_layernorm_without_gradients_is_not_differentiated_as_one():
    """Its graph is LayerNorm's, its derivatives are not: the products are autograd's, the dense Hessian's."""

    class NoGradient(nn.LayerNorm):
        def forward(self, x):
            with torch.no_grad():
                return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), NoGradient(6), nn.Linear(6, 3)).double().eval()
    x = torch.randn(5, 4, dtype=torch.float64)
    obj = Objective(model, nn.MSELoss(), (x, torch.randn(5, 3, dtype=torch.float64)))
    assert obj.hvp_strategy() != "rop"
    v = torch.randn(obj.layout.size, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    ref = dense_hessian(obj) @ v
    torch.testing.assert_close(obj.hvp(v), ref, rtol=0, atol=1e-12 * float(ref.abs().max()))


def test_an_identity_with_a_backward_hook_stays_a_call():
    """A gradient reversal (a backward hook on an identity) is no forward computation: the graph keeps the call, so
    the group of the function is found (before, tracing through dropped the hook and the graph was refused)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Identity(), nn.Linear(6, 3)).double().eval()
    model[2].register_full_backward_pre_hook(lambda module, grad_output: (-grad_output[0],))
    x = torch.randn(5, 4, dtype=torch.float64)
    traced = manifolds.trace_network(model, x)
    assert traced.failure is None and any(n.op == "call_module" and n.target == "2" for n in traced.graph.nodes)
    assert manifolds.transformer_symmetry(model, x).dim == 6


def test_the_analysis_leaves_a_counting_buffer_as_found():
    """A LayerNorm subclass counting its calls in a buffer: finding the group runs its forward (the trace, probes of
    the layers, the subclass check) and puts the count back each time; before, finding the group left it moved."""

    class Counting(nn.LayerNorm):
        def __init__(self, dim: int):
            super().__init__(dim)
            self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

        def forward(self, x):
            self.calls.add_(1)
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), Counting(6), nn.Linear(6, 3)).double().eval()
    assert manifolds.transformer_symmetry(model, torch.randn(5, 4, dtype=torch.float64)).dim == 6
    assert float(model[2].calls) == 0.0


def test_a_reassigned_resized_or_meta_buffer_is_left_as_found_by_the_analysis():
    """A forward that reassigns a buffer (``self.step = self.step + 1``) or resizes one, beside a buffer on the meta
    device that no pass reads: the analysis puts back each tensor, its shape and values, and skips the meta one."""

    class Stateful(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
            self.register_buffer("step", torch.zeros(()))
            self.register_buffer("seen", torch.zeros(1))
            self.register_buffer("spare", torch.empty(3, device="meta"))

        def forward(self, x):
            self.step = self.step + 1
            self.seen.resize_(5).fill_(1.0)
            return self.b(torch.relu(self.a(x)))

    model = Stateful().double().eval()
    step, seen = model.step, model.seen
    assert manifolds.transformer_symmetry(model, torch.randn(5, 4, dtype=torch.float64)).dim == 6
    assert model.step is step and float(step) == 0.0
    assert model.seen is seen and tuple(seen.shape) == (1,) and float(seen[0]) == 0.0


def test_the_metric_weighs_an_output_projection_under_a_layer_scale_by_gamma_squared():
    """``proj``'s rows move with ``ls1.gamma`` (a diagonal factor) and its head columns with the value/output GL
    factors: the metric on a head's columns is ``tr((X^T Q X)^-1 xi^T Q xi)`` with ``Q = diag(gamma^2)``, and on the
    bias ``sum gamma_j^2 xi_j^2`` (explicit formulas; invariant since ``gamma^2`` scales as the rows' inverse
    squares)."""
    model, x = _small(init_values=0.5, global_pool="avg")
    params = {n: p.detach() for n, p in model.named_parameters()}
    metric = manifolds.symmetry_metric(manifolds.transformer_symmetry(model, x), params)
    layout = manifolds.ParamLayout.from_tensors(params)
    w, q = layout.flatten(params), params["blocks.0.ls1.gamma"] ** 2
    g = torch.Generator().manual_seed(5)

    def form(name: str, where, entries: torch.Tensor) -> float:
        xi = {n: torch.zeros_like(p) for n, p in params.items()}
        xi[name][where] = entries
        v = layout.flatten(xi)
        return float(v @ metric.apply(w, v))

    weight = params["blocks.0.attn.proj.weight"]
    for h in range(HEADS):
        cols = slice(4 * h, 4 * (h + 1))
        X, xi = weight[:, cols], torch.randn(8, 4, generator=g, dtype=torch.float64)
        want = torch.trace(torch.linalg.solve(X.T @ (q[:, None] * X), xi.T @ (q[:, None] * xi)))
        assert form("blocks.0.attn.proj.weight", (slice(None), cols), xi) == pytest.approx(float(want), rel=1e-12)
    xi = torch.randn(8, generator=g, dtype=torch.float64)
    assert form("blocks.0.attn.proj.bias", slice(None), xi) == pytest.approx(float((q * xi**2).sum()), rel=1e-12)
