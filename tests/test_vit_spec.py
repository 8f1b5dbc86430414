"""The built-in vision transformer (``--model vit``, sharpness/_vit.py): its spec, its symmetry group, a short
training run, and a checkpoint going through safetensors and the command line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import manifolds
from landscape._demo import demo_model, recipe, run_demo
from sharpness._cli import main as sharpness_main
from sharpness._specs import SpecError, build_model, load_checkpoint
from sharpness._vit import HandAttention

SMALL = "vit:dim=8,heads=2"  # head size 4: the symmetry checks stay fast


def _keys(depth: int, attn: str) -> set[str]:
    """The state-dict keys the module docstring of sharpness/_vit.py documents."""
    keys = {"embed.weight", "embed.bias", "pos", "norm.weight", "norm.bias", "head.weight", "head.bias"}
    proj = ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    if attn == "hand":
        proj = [f"{r}.{p}" for r in "qkvo" for p in ("weight", "bias")]
    for i in range(depth):
        keys |= {f"blocks.{i}.{n}.{p}" for n in ("ln1", "ln2", "fc1", "fc2") for p in ("weight", "bias")}
        keys |= {f"blocks.{i}.attn.{p}" for p in proj}
    return keys


def test_default_spec():
    model = build_model("vit")
    (block,) = model.blocks
    assert isinstance(block.attn, nn.MultiheadAttention) and block.attn.num_heads == 2 and block.attn.batch_first
    assert model.embed.out_features == 16 and block.fc1.out_features == 32 and isinstance(block.act, nn.ReLU)
    assert block.pre and model.head.out_features == 10 and model.pos.shape == (16, 16)
    assert set(model.state_dict()) == _keys(1, "mha")


def test_every_option_is_parsed():
    model = build_model("vit:dim=12,heads=3,depth=2,mlp=7,norm=post,act=gelu,attn=hand,classes=4")
    assert len(model.blocks) == 2 and model.embed.out_features == 12 and model.head.out_features == 4
    for block in model.blocks:
        assert isinstance(block.attn, HandAttention) and block.attn.heads == 3 and block.attn.q.out_features == 12
        assert block.fc1.out_features == 7 and isinstance(block.act, nn.GELU) and not block.pre
    assert set(model.state_dict()) == _keys(2, "hand")
    assert model(torch.rand(3, 64)).shape == (3, 4)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("vit:depth", "is not KEY=VALUE"),
        ("vit:width=2", "unknown option(s) width"),
        ("vit:dim=x", "dim must be a positive integer"),
        ("vit:heads=0", "heads must be a positive integer"),
        ("vit:mlp=-3", "mlp must be a positive integer"),
        ("vit:dim=10,heads=3", "must be a multiple of heads"),
        ("vit:norm=middle", "norm is pre or post"),
        ("vit:act=tanh", "act is relu or gelu"),
        ("vit:attn=flash", "attn is mha or hand"),
    ],
)
def test_bad_specs_are_refused_in_one_sentence(spec, fragment):
    with pytest.raises(SpecError) as err:
        build_model(spec)
    message = str(err.value)
    assert fragment in message and spec in message and "\n" not in message


@pytest.mark.parametrize("attn", ["mha", "hand"])
def test_flat_and_image_inputs_agree_and_the_model_traces(attn):
    torch.manual_seed(0)
    model = build_model(f"{SMALL},attn={attn}").eval()
    x = torch.rand(5, 64)
    with torch.no_grad():
        assert torch.equal(model(x), model(x.reshape(5, 1, 8, 8)))
        # token 1 is the 2x2 patch at rows 0-1, columns 2-3: moving a pixel elsewhere must change the output
        assert not torch.allclose(model(x), model(x.roll(1, dims=1)))
    traced = manifolds.trace_network(model, x)
    assert traced.has_shapes, traced.failure


@pytest.mark.parametrize("attn", ["mha", "hand"])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_transformer_symmetry_finds_two_gl_factors_per_head(attn, norm):
    torch.manual_seed(0)
    model = build_model(f"{SMALL},attn={attn},norm={norm}").double().eval()
    x = torch.rand(6, 64, dtype=torch.float64)
    sym = manifolds.transformer_symmetry(model, x)
    gl = [f for f in sym.factors if f.kind == "GL" and f.size == 4]
    # dim 8, 2 heads of size 4: per head GL(4) on (query, key) and GL(4) on (value, output), 16 each;
    # pre-LN: ln1 and ln2 affine scales traded (8 each; post-LN they feed residual additions: pinned);
    # 16 ReLU units of the MLP; the final LayerNorm's 8 scales against the head (the diagonal group).
    assert len(gl) == 4 and sum(f.dim for f in gl) == 2 * 2 * 4 * 4, sym.describe()
    assert sum("query/key" in f.label for f in gl) == 2 and sum("value/output" in f.label for f in gl) == 2
    assert sym.dim == 64 + (16 if norm == "pre" else 0) + 16 + 8, sym.describe()
    with torch.no_grad():
        moved = sym.transformed(model, sym.random_element(1.0, torch.Generator().manual_seed(1)))
        assert (moved(x) - model(x)).abs().max() < 1e-10


def test_a_few_adam_steps_decrease_the_loss():
    torch.manual_seed(0)
    X = torch.rand(128, 64)
    y = (X @ torch.randn(64, 10)).argmax(1)  # labels a linear function of the pixels: quickly learnt
    model = build_model(SMALL)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.no_grad():
        before = float(F.cross_entropy(model(X), y))
    for _ in range(30):
        opt.zero_grad()
        F.cross_entropy(model(X), y).backward()
        opt.step()
    with torch.no_grad():
        after = float(F.cross_entropy(model(X), y))
    assert after < 0.8 * before, (before, after)


def test_checkpoint_round_trip_and_the_command_line(tmp_path, capsys):
    torch.manual_seed(0)
    model = build_model("vit:attn=hand")
    path = tmp_path / "vit.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    loaded = load_checkpoint(build_model("vit:attn=hand"), str(path))
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(loaded(x), model.eval()(x))
    with pytest.raises(SpecError, match="does not fit the model"):  # the other attention's keys
        load_checkpoint(build_model("vit"), str(path))
    out = tmp_path / "r.json"
    argv = ["compute", "--model", "vit:attn=hand", "--checkpoint", str(path), "--data",
            "synthetic:n=24,dim=64,classes=10", "--metric", "euclidean", "--quiet", "--json", str(out)]  # fmt: skip
    assert sharpness_main(argv) == 0
    report = json.loads(out.read_text())
    assert report["measures"]["euclidean"]["value"] > 0


def test_the_demo_trains_vit_with_adam_and_refuses_other_models(tmp_path):
    assert recipe("vit:attn=hand").optimizer == "adam" and recipe("mlp:64-32-10").optimizer == "sgd"
    X = torch.rand(2, 64)
    assert demo_model("vit", X).head.out_features == 10
    for spec, fragment in [("lenet", "the demo trains"), ("vit:classes=3", "10 classes"), ("mlp:64-10", "two layers")]:
        with pytest.raises(SpecError, match=fragment):
            run_demo(str(tmp_path / "out"), model=spec, progress=False)
    assert not list(tmp_path.iterdir())  # refused before anything was written
