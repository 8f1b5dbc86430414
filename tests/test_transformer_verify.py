"""Verify, random_rescale and analyze on tiny float64 transformers, the token-wise diagonal group and landscape grids
over attention.

Group elements are written here on the state dict (per head ``Wq_h <- A^T Wq_h``, ``Wk_h <- A^-1 Wk_h``,
``Wv_h <- B^T Wv_h``, the output projection's head columns ``<- (.) B^-T``; a LayerNorm's scale and shift ``* c``
with the columns reading it ``/ c``; ReLU units' rows ``* c`` with the next layer's columns ``/ c``), independently
of the library's factors.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import manifolds
from landscape._grid import evaluate_grid
from sharpness import MEASURES, InvarianceReport, Objective, Rescalings, Solver, verify_invariance
from sharpness._cli import main as sharpness_main
from sharpness._specs import build_model
from sharpness.measures import Ascent, adaptive_sharpness, geodesic_sharpness
from sharpness.measures._draws import ALL_KINDS, Draws

D, H, HD, FF, T, N = 4, 2, 2, 4, 3, 4  # width, heads, head size, MLP width, tokens, samples


class Block(nn.Module):
    """Pre- or post-LayerNorm block, attention by nn.MultiheadAttention or written by hand (SDPA)."""

    def __init__(self, pre: bool, hand: bool):
        super().__init__()
        self.pre, self.hand = pre, hand
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        if hand:
            self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))
        else:
            self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)

    def attend(self, y):
        if not self.hand:
            return self.attn(y, y, y, need_weights=False)[0]
        q, k, v = (m(y).unflatten(-1, (H, HD)).transpose(1, 2) for m in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))

    def forward(self, x):
        if self.pre:
            x = x + self.attend(self.ln1(x))
            return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))
        x = self.ln1(x + self.attend(x))
        return self.ln2(x + self.fc2(torch.relu(self.fc1(x))))


class Net(nn.Module):
    def __init__(self, blocks: int, pre: bool, hand: bool):
        super().__init__()
        self.blocks = nn.Sequential(*(Block(pre, hand) for _ in range(blocks)))
        self.head = nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean(dim=1))


def make(blocks=1, pre=True, hand=False, seed=0):
    torch.manual_seed(seed)
    model = Net(blocks, pre, hand).double().eval()
    with torch.no_grad():  # away from the default initialization (unit LayerNorm scales, zero biases)
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(N, T, D, dtype=torch.float64)
    return model, x, torch.randint(0, 3, (N,))


# -- group elements by hand -------------------------------------------------------------------------------------
def hand_element(model, g, strength=1.0):
    """A copy of ``model`` moved by a hand-written element: every head's A and B (``I + strength/2 Z``), every
    LayerNorm feeding only Linears/attention traded and every block's ReLU units scaled (``exp(0.7 strength z)``)."""

    def _gl(g):
        return torch.eye(HD, dtype=torch.float64) + 0.5 * strength * torch.randn(HD, HD, generator=g,
                                                                                 dtype=torch.float64)

    def _scales(g, k):
        return torch.exp(0.7 * strength * torch.randn(k, generator=g, dtype=torch.float64))

    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.blocks):
        p = f"blocks.{i}."
        for h in range(H):
            a, b = _gl(g), _gl(g)
            rows = slice(h * HD, (h + 1) * HD)
            if block.hand:
                moves = [("q", a.T), ("k", torch.linalg.inv(a)), ("v", b.T)]
                for role, m in moves:
                    sd[f"{p}{role}.weight"][rows] = m @ sd[f"{p}{role}.weight"][rows]
                    sd[f"{p}{role}.bias"][rows] = m @ sd[f"{p}{role}.bias"][rows]
                out = f"{p}o.weight"
            else:
                for j, m in enumerate([a.T, torch.linalg.inv(a), b.T]):
                    r = slice(j * D + h * HD, j * D + (h + 1) * HD)
                    sd[f"{p}attn.in_proj_weight"][r] = m @ sd[f"{p}attn.in_proj_weight"][r]
                    sd[f"{p}attn.in_proj_bias"][r] = m @ sd[f"{p}attn.in_proj_bias"][r]
                out = f"{p}attn.out_proj.weight"
            sd[out][:, rows] = sd[out][:, rows] @ torch.linalg.inv(b).T
        if block.pre:  # ln1 feeds the attention's inputs only, ln2 fc1 only
            c = _scales(g, D)
            sd[f"{p}ln1.weight"] *= c
            sd[f"{p}ln1.bias"] *= c
            readers = [f"{p}{r}.weight" for r in "qkv"] if block.hand else [f"{p}attn.in_proj_weight"]
            for r in readers:
                sd[r] /= c
            c = _scales(g, D)
            sd[f"{p}ln2.weight"] *= c
            sd[f"{p}ln2.bias"] *= c
            sd[f"{p}fc1.weight"] /= c
        c = _scales(g, FF)
        sd[f"{p}fc1.weight"] *= c[:, None]
        sd[f"{p}fc1.bias"] *= c
        sd[f"{p}fc2.weight"] /= c
    twin = copy.deepcopy(model)
    twin.load_state_dict(sd)
    return twin


CASES = {
    "one_pre_mha": dict(blocks=1, pre=True, hand=False),
    "one_post_hand": dict(blocks=1, pre=False, hand=True),
    "two_pre_hand": dict(blocks=2, pre=True, hand=True),
    "two_post_mha": dict(blocks=2, pre=False, hand=False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_random_rescale_draws_the_whole_group_and_analyze_describes_it(name):
    model, x, _ = make(**CASES[name])
    cfg = CASES[name]
    structure = manifolds.analyze(model, x)
    sym = structure.symmetry
    text = structure.describe()
    # by hand: per block 2 GL(HD) per head, the ReLU units (FF) and, pre-LN, both LayerNorm trades (D each); post-LN
    # only the last ln2 trades (against the head, through the mean over tokens): the others feed a residual sum
    per_block = 2 * H * HD * HD + FF + (2 * D if cfg["pre"] else 0)
    assert sym.dim == cfg["blocks"] * per_block + (0 if cfg["pre"] else D), text
    text = structure.describe()
    assert text.count(f"GL({HD})") == 2 * H * cfg["blocks"] and "node-wise rescaling group" in text
    with torch.no_grad():
        ref = model(x)
        for seed in range(2):
            twin = manifolds.random_rescale(model, "group", 1.0, torch.Generator().manual_seed(seed), example_input=x)
            assert (twin(x) - ref).abs().max() < 1e-10
            moved = max((p - q).abs().max() for p, q in zip(model.parameters(), twin.parameters()))
            assert moved > 0.1
        hand = hand_element(model, torch.Generator().manual_seed(5))
        assert (hand(x) - ref).abs().max() < 1e-10  # the hand element is a symmetry too


def test_measures_on_a_hand_built_element():
    """The symmetry measure and second-order geodesic sharpness on its metric are unchanged by a hand-built element
    (to 1e-8); Euclidean and adaptive sharpness move."""
    model, x, y = make(blocks=1, pre=True, hand=False)
    twin = hand_element(model, torch.Generator().manual_seed(1), strength=2.0)
    loss = nn.CrossEntropyLoss()
    solver = Solver(tol=1e-10)
    values = {}
    for key, m in (("model", model), ("twin", twin)):
        obj = Objective(m, loss, (x, y))
        eig = {n: MEASURES[n].sharpness(obj, 1, solver, progress=False).value for n in ("symmetry", "euclidean")}
        ascent = Ascent(steps=3, restarts=0, eigen_start=False)  # from the centre: the path is covariant
        geo = geodesic_sharpness(None, None, None, 0.05, metric="symmetry", order=2, ascent=ascent, objective=obj,
                                 progress=False)
        ada = adaptive_sharpness(None, None, None, 0.05, ascent=ascent, objective=obj, progress=False)
        values[key] = {**eig, "geodesic": geo.value, "adaptive": ada.value}
        assert set(geo.invariant_under) >= {"attention", "normalization"}
    a, b = values["model"], values["twin"]
    assert abs(a["symmetry"] - b["symmetry"]) <= 1e-8 * abs(a["symmetry"])
    assert a["geodesic"] > 0 and abs(a["geodesic"] - b["geodesic"]) <= 1e-8 * a["geodesic"]
    assert max(a["euclidean"], b["euclidean"]) > 1.5 * min(a["euclidean"], b["euclidean"])
    assert max(a["adaptive"], b["adaptive"]) > 1.2 * min(a["adaptive"], b["adaptive"])


def test_verify_checks_the_whole_group_on_a_transformer():
    model, x, y = make(blocks=1, pre=True, hand=True)
    # by default: node and layer, and the kinds this network has
    assert Draws(manifolds.analyze(model, x), dict(model.named_parameters()), None).kinds == ALL_KINDS
    rep = verify_invariance(model, nn.CrossEntropyLoss(), (x, y), ["euclidean", "symmetry"], balls=0.05,
                            rescalings=Rescalings(("attention", "group"), trials=1), solver=Solver(tol=1e-9),
                            progress=False)  # fmt: skip
    assert rep.metrics == ("euclidean", "symmetry", "geodesic", "adaptive")
    assert rep.claims["symmetry"] == rep.claims["geodesic"] == ALL_KINDS and rep.claims["euclidean"] == ()
    assert rep.claims["adaptive"] == ("node", "layer", "normalization")  # the entry-wise scalings only
    for m in ("symmetry", "geodesic"):
        assert all(rep.verdict(m, kind) == "invariant" for kind in rep.kinds), rep.table()
    for m in ("euclidean", "adaptive"):
        assert rep.verdict(m, "attention") == "changes" and rep.verdict(m, "group") == "changes", rep.table()
    assert max(rep.output_differences["group"]) < 1e-12 and rep.outcome == "passed"
    assert rep.group["attention_factors"] == 2 * H and rep.group["normalization_factors"] == 2
    again = InvarianceReport.from_dict(json.loads(json.dumps(rep.to_dict())))
    assert again.kinds == rep.kinds and again.outcome == "passed"
    # asked for on a network without attention: skipped with the reason, nothing claimed
    mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double().eval()
    data = (torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64))
    rep = verify_invariance(mlp, nn.MSELoss(), data, ["node"], rescalings=Rescalings(("node", "attention"), 1),
                            progress=False)  # fmt: skip
    assert rep.kinds == ("node",) and "no attention head" in rep.skipped_kinds["attention"]
    with pytest.raises(ValueError, match="kinds must be"):
        Rescalings(kinds=("heads",))


def test_token_wise_relu_units_are_the_last_axis():
    """(batch, tokens, features): a Linear acts on the last axis, so the hidden ReLU units are free scales."""
    torch.manual_seed(0)

    class TokenMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.head = nn.Linear(D, 6), nn.Linear(6, D), nn.Linear(D, 3)

        def forward(self, x):
            return self.head(self.fc2(F.relu(self.fc1(x))).mean(dim=1))

    model = TokenMLP().double()
    x = torch.randn(N, T, D, dtype=torch.float64)
    group = manifolds.analyze(model, x).group
    assert group.dim == 6 + D, group.describe()  # fc1's units and fc2's outputs (read by the head through a mean)
    with torch.no_grad():
        ref = model(x)
        twin = manifolds.random_rescale(model, "node", 1.0, torch.Generator().manual_seed(0), example_input=x)
        assert (twin(x) - ref).abs().max() < 1e-12
        assert (twin.fc1.bias / model.fc1.bias - 1).abs().max() > 0.1  # the units did move
        # by hand: unit j of fc1 times c_j, the columns of fc2 reading it divided by c_j
        c = torch.exp(torch.randn(6, dtype=torch.float64))
        hand = copy.deepcopy(model)
        hand.fc1.weight.mul_(c[:, None])
        hand.fc1.bias.mul_(c)
        hand.fc2.weight.div_(c)
        assert (hand(x) - ref).abs().max() < 1e-12


def test_landscape_grid_runs_attention_through_the_math_kernel():
    """The vmapped grid does not take MultiheadAttention's fused fast path (vmap warned about it), and gives the
    loop's values."""
    model, x, y = make(blocks=1, pre=True, hand=False)
    obj = Objective(model, nn.CrossEntropyLoss(), (x, y))
    d = torch.randn(2, obj.layout.size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    coords = torch.tensor([[0.0, 0.0], [0.1, -0.2], [0.3, 0.1]], dtype=torch.float64)
    fast = torch.backends.mha.get_fastpath_enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        batched = evaluate_grid(obj, d, coords, strategy="vmap", progress=False)
    loop = evaluate_grid(obj, d, coords, strategy="loop", progress=False)
    assert torch.backends.mha.get_fastpath_enabled() == fast  # given back as found
    assert abs(batched.loss - loop.loss).max() < 1e-12
    assert abs(batched.loss[0] - obj.evaluate()["loss"]) < 1e-12



def test_verify_on_the_built_in_transformer_from_the_command_line(tmp_path):
    """A fresh ``vit`` (zero LayerNorm shifts, where the node metric is undefined): verify draws the attention
    factors, the symmetry measure holds to rtol and the Euclidean one moves."""
    spec = "vit:dim=4,heads=2,mlp=4,classes=3"
    torch.manual_seed(0)
    path, out = tmp_path / "vit.safetensors", tmp_path / "v.json"
    save_file({k: v.contiguous() for k, v in build_model(spec).state_dict().items()}, str(path))
    argv = ["verify", "--model", spec, "--checkpoint", str(path), "--data", "synthetic:n=8,dim=64,classes=3",
            "--metric", "symmetry", "--metric", "euclidean", "--kind", "attention", "--trials", "1", "--quiet",
            "--json", str(out)]  # fmt: skip
    assert sharpness_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["kinds"] == ["attention"] and report["group"]["attention_factors"] == 4
    assert report["verdicts"] == {"symmetry": {"attention": "invariant"}, "euclidean": {"attention": "changes"}}
