"""Models where the symmetry analysis must not claim more than the network has: normalization subclasses with their
own forward, an attention module whose output projection is also called alone or that is called twice, one
LayerNorm called on channels along two different axes, token-id models (whose outputs the rescaled copy is checked
on through the example input), and frozen layers under the measures that reparametrize whole layers.

Each case checks the function: a random element of every kind the analysis claims leaves the outputs unchanged to
1e-12 in float64.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import manifolds
from sharpness import Solver, measure_sharpness, verify_invariance


def _unchanged(model: nn.Module, x: torch.Tensor, kinds=("node", "layer", "group")) -> None:
    """Every kind's random copy computes ``model``'s function to 1e-12 (float64)."""
    with torch.no_grad():
        out = model(x)
        for kind in kinds:
            twin = manifolds.random_rescale(model, kind=kind, generator=torch.Generator().manual_seed(1),
                                            example_input=x)  # fmt: skip
            assert float((twin(x) - out).abs().max()) <= 1e-12 * float(out.abs().max()), kind


class OnePlusNorm(nn.LayerNorm):
    """Gemma's norm: a LayerNorm subclass whose own forward scales by ``1 + weight``."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, None, None, self.eps) * (1 + self.weight) + self.bias


class OnePlusBatchNorm(nn.BatchNorm1d):
    def forward(self, x):
        return F.batch_norm(x, self.running_mean, self.running_var, None, None, False, 0.0, self.eps) \
            * (1 + self.weight) + self.bias  # fmt: skip


@pytest.mark.parametrize("norm", [OnePlusNorm(6), OnePlusBatchNorm(6)], ids=["LayerNorm", "BatchNorm1d"])
def test_a_normalization_subclass_with_its_own_forward_is_not_read_as_the_stock_one(norm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), norm, nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)).double().eval()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(5, 4, dtype=torch.float64)
    structure = manifolds.analyze(model, x)
    # the stock rule would trade the norm's scale against the next layer (6 more dimensions): not a symmetry here
    assert structure.group.dim == 6
    _unchanged(model, x)


class Attention(nn.Module):
    def __init__(self, case: str):
        super().__init__()
        self.case, self.att, self.head = case, nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 3)

    def forward(self, x):
        h = x.unflatten(1, (3, 8))
        out = self.att(h, h, h, need_weights=False)[0]
        if self.case == "out_proj also called alone":
            out = out + self.att.out_proj(h)
        else:  # "called twice"
            out = self.att(out, out, out, need_weights=False)[0]
        return self.head(out.mean(1))


def test_an_attention_whose_output_projection_is_also_called_alone_keeps_no_value_output_factor():
    torch.manual_seed(0)
    model, x = Attention("out_proj also called alone").double().eval(), torch.randn(5, 24, dtype=torch.float64)
    symmetry = manifolds.analyze(model, x).symmetry
    assert not any("value/output" in f.label for f in symmetry.factors)
    _unchanged(model, x, kinds=("group",))


def test_an_attention_module_called_twice_has_one_set_of_factors():
    """The same weights act on both calls: each head's two GL(4) factors hold for both, counted once."""
    torch.manual_seed(0)
    model, x = Attention("called twice").double().eval(), torch.randn(5, 24, dtype=torch.float64)
    symmetry = manifolds.analyze(model, x).symmetry
    assert len(symmetry.factors) == 4 and symmetry.dim == 4 * 16
    _unchanged(model, x, kinds=("group",))


def test_one_layer_norm_called_on_tokens_and_on_a_sum_is_analyzed_without_error():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.a, self.h = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            return self.h(self.ln(x + self.a(self.ln(x))).mean(1))

    torch.manual_seed(0)
    model, x = Twice().double().eval(), torch.randn(3, 5, 8, dtype=torch.float64)
    manifolds.analyze(model, x)
    _unchanged(model, x)


class NormTwice(nn.Module):
    """One token-wise LayerNorm called twice on ``(N, T, D)`` inputs. ``"tanh"``, ``"gelu"``, ``"residual"``: the
    outputs of the two calls are added (once through tanh, once behind a GELU MLP or a residual sum), which pins the
    gain; ``"linear"``: each call read by a Linear alone, so the one gain is traded against both readers' columns."""

    def __init__(self, how: str, d: int = 6):
        super().__init__()
        self.how, self.n, self.h = how, nn.LayerNorm(d), nn.Linear(d, 2)
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        if self.how == "tanh":
            return self.h(torch.tanh(self.n(x)) + self.n(torch.tanh(x))).mean(1)
        if self.how == "gelu":
            return self.h((x + F.gelu(self.a(self.n(x))) + self.n(F.gelu(x))).mean(1))
        if self.how == "residual":
            return self.h((x + self.a(F.gelu(self.b(self.n(x)))) + self.n(x)).mean(1))
        return self.h(torch.relu(self.a(self.n(x)) + self.b(self.n(torch.tanh(x)))).mean(1))


@pytest.mark.parametrize("how, dim", [("tanh", 0), ("gelu", 0), ("residual", 0), ("linear", 6 + 6)])
def test_a_token_wise_layer_norm_called_twice_reads_its_gain_along_the_features(how, dim):
    """The second call's output holds the first's variables along the same (last) axis: analyzed without error (it
    raised a length mismatch), the gain traded only where every call's output is read by Linears alone (the 6 gains
    and the ReLU's 6 units)."""
    torch.manual_seed(0)
    model, x = NormTwice(how).double().eval(), torch.randn(3, 4, 6, dtype=torch.float64)
    group = manifolds.analyze(model, x).symmetry
    assert group.dim == dim, group.describe()
    _unchanged(model, x)
    if dim:
        with torch.no_grad():  # the LayerNorm's bias off zero, where the node metric is defined
            model.n.bias.normal_()
        y = torch.randn(3, 2, dtype=torch.float64)
        report = verify_invariance(model, nn.MSELoss(), (x, y), ["symmetry"], solver=Solver(tol=1e-10),
                                   progress=False)  # fmt: skip
        verdicts = [report.verdict("symmetry", k) for k in report.kinds]
        assert report.outcome == "passed" and verdicts and set(verdicts) == {"invariant"}, report.table()


class TokenIds(nn.Module):
    """Token ids through an embedding: a float random input is refused, so the copy is checked on the example."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.emb, self.a, self.norm, self.b = nn.Embedding(10, 6), nn.Linear(6, 6), norm, nn.Linear(6, 3)

    def forward(self, ids):
        return self.b(self.norm(F.relu(self.a(self.emb(ids)))).mean(1))


def test_the_rescaled_copy_of_a_token_id_model_is_checked_on_the_example_input(monkeypatch):
    torch.manual_seed(0)
    model, ids = TokenIds(nn.LayerNorm(6)).double().eval(), torch.randint(0, 10, (4, 5))
    _unchanged(model, ids)
    # a group that is not a symmetry (the stock rule on Gemma's norm, forced) is caught on the example input
    from manifolds import _group_discovery

    monkeypatch.setattr(_group_discovery, "_plain_norm", lambda m: isinstance(m, nn.LayerNorm))
    broken = TokenIds(OnePlusNorm(6)).double().eval()
    with torch.no_grad():
        broken.norm.weight.normal_()
    with pytest.raises(ValueError, match="not a symmetry of this model"):
        manifolds.random_rescale(broken, kind="node", example_input=ids, scale=1.0,
                                 generator=torch.Generator().manual_seed(1))  # fmt: skip


def test_measures_of_whole_layers_refuse_a_frozen_bias_and_verify_skips_them():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3)).double().eval()
    model[0].bias.requires_grad_(False)
    data = (torch.randn(20, 4, dtype=torch.float64), torch.randint(0, 3, (20,)))
    for name in ("fixed", "gspace"):
        with pytest.raises(manifolds.UnsupportedModelError, match=r"0\.bias is not one of the trainable parameters"):
            measure_sharpness(model, nn.CrossEntropyLoss(), data, name, progress=False)
    report = verify_invariance(model, nn.CrossEntropyLoss(), data, progress=False)
    assert {"fixed", "gspace"} <= set(report.skipped)
