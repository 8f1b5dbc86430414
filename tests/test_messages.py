"""Messages a person reads: short summaries instead of hundreds of key names, skip reasons outside the results
table, one style for every command-line error, and help texts that state every default."""

from __future__ import annotations

import argparse
import re

import pytest
import torch
from safetensors.torch import save_file

import landscape._cli as landscape_cli
import sharpness._cli as sharpness_cli
from landscape._directions import require_chain
from manifolds import UnsupportedModelError
from sharpness._specs import SpecError, build_model, describe_mismatch, load_checkpoint
from sharpness.measures._claims import skip_notes

# The longest a one-line refusal of a mismatched checkpoint may be: a few names, never the whole state_dict.
MAX_MESSAGE = 400


@pytest.fixture(scope="module")
def resnet_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in build_model("resnet:20").state_dict().items()}


def test_a_checkpoint_saved_from_a_wrapper_names_the_prefix_and_the_fix(resnet_state, tmp_path):
    path = tmp_path / "ddp.safetensors"
    save_file({f"module.{k}": v for k, v in resnet_state.items()}, path)
    with pytest.raises(SpecError) as err:
        load_checkpoint(build_model("resnet:20"), str(path))
    message = str(err.value)
    assert len(message) < MAX_MESSAGE and "layer1.0.conv1.weight" not in message, message
    n = len(resnet_state)
    assert f"checkpoint {path} does not fit the model: every one of its {n} keys starts with " in message
    assert "'module.'" in message and "k.removeprefix('module.')" in message


def test_a_model_that_wraps_the_checkpoints_module_names_the_prefix(resnet_state):
    message = describe_mismatch({f"model.{k}": v for k, v in resnet_state.items()}, resnet_state)
    assert message.startswith(f"every one of the model's {len(resnet_state)} keys starts with 'model.'"), message
    assert "'model.' + k" in message


def test_missing_unexpected_and_misshapen_keys_are_counted_with_the_first_few(resnet_state):
    deeper = build_model("resnet:32").state_dict()
    message = describe_mismatch(resnet_state, deeper)  # a ResNet-32 checkpoint for a ResNet-20
    extra = len(deeper) - len(resnet_state)
    assert message.startswith(f"{extra} of the checkpoint's {len(deeper)} keys are not in the model "
                              "('layer1.3.conv1.weight', 'layer1.3.bn1.weight', 'layer1.3.bn1.bias', ...)")  # fmt: skip
    assert message.endswith("check the --model spec (depth, widths, classes) against the checkpoint's model")
    assert len(message) < MAX_MESSAGE
    message = describe_mismatch(deeper, resnet_state)
    assert message.startswith(f"{extra} of the model's {len(deeper)} keys are missing ('layer1.3.conv1.weight'")
    wide = build_model("resnet:20,width=2").state_dict()
    message = describe_mismatch(resnet_state, wide)
    assert message.startswith("106 tensor(s) differ in shape (first 'conv.weight': (32, 3, 3, 3) in the checkpoint, "
                              "(16, 3, 3, 3) in the model)"), message  # fmt: skip
    one = dict(resnet_state)
    one["fc.weights"] = one.pop("fc.weight")
    assert describe_mismatch(resnet_state, one).startswith(
        "1 of the model's 128 keys is missing ('fc.weight'); 1 of the checkpoint's 128 keys is not in the model "
        "('fc.weights')"
    )
    assert describe_mismatch(resnet_state, resnet_state) is None


def test_a_coincidence_is_not_reported_as_a_prefix(resnet_state):
    """``0.weight`` of an MLP ends ``layer2.0.shortcut.0.weight`` of a ResNet: that is not a prefix to strip."""
    message = describe_mismatch(resnet_state, build_model("mlp:64-16-10").state_dict())
    assert "prefix" not in message and message.startswith("128 of the model's 128 keys are missing")
    half = {(f"module.{k}" if i % 2 else k): v for i, (k, v) in enumerate(resnet_state.items())}
    assert "some keys differ only by a prefix (the checkpoint adds 'module.')" in describe_mismatch(resnet_state, half)


LONG = "Cannot build the G-space parametrization, which is defined for chains: " + "module 'x' is not, " * 40


def test_skip_reasons_leave_the_table_as_numbered_tags_with_short_lines_and_a_pointer():
    entry = {"loss": 1.0, "n_params": 10, "data": "digits", "group": None, "epsilon": None, "adaptive": None,
             "geodesic": None}  # fmt: skip
    measured = {"value": 2.0, "n_hvp": 5, "converged": True, "seconds": 0.1, "n_params": 10, "n_dropped": 0,
                "n_measured": 10, "invariant_under": ["node"]}  # fmt: skip
    measures = {
        "euclidean": {**measured, "invariant_under": []},
        "fixed": {"skipped": LONG.replace("the G-space parametrization", "fixed weights"),
                  "skip_reason": "needs a chain of layers"},
        "gspace": {"skipped": LONG, "skip_reason": "needs a chain of layers"},
        "symmetry": {"skipped": "The symmetry metric is undefined at this point: " + "w, " * 200,
                     "skip_reason": "degenerate point"},
    }  # fmt: skip
    table = sharpness_cli._table({**entry, "measures": measures}, "out.json").splitlines()
    assert "fixed      skipped (1)" in table and "gspace     skipped (1)" in table and "symmetry   skipped (2)" in table
    notes = [line for line in table if line.startswith("skipped (")]
    assert notes[0].startswith("skipped (1) fixed, gspace: needs a chain of layers; cannot build fixed weights, ")
    assert notes[1].startswith("skipped (2) symmetry: degenerate point; the symmetry metric is undefined")
    assert all(len(line) <= 180 and line.endswith(" ...") for line in notes), notes
    assert table[-1] == "whole reasons: measures.NAME.skipped in out.json"
    assert max(len(line) for line in table) <= 180
    without_json = sharpness_cli._table({**entry, "measures": measures})
    assert without_json.endswith("whole reasons: add --json FILE and read measures.NAME.skipped")
    assert skip_notes({}, "anywhere") == ({}, [])


def test_every_command_line_error_starts_with_lowercase_error(capsys):
    def fail(argv):
        raise UnsupportedModelError("Cannot build the G-space parametrization for this model.")

    assert sharpness_cli.run_command(fail, []) == 2
    assert capsys.readouterr().err == "error: cannot build the G-space parametrization for this model.\n"

    def acronym(argv):
        raise SpecError("CUDA is not available; use --device cpu")

    assert sharpness_cli.run_command(acronym, []) == 2
    assert capsys.readouterr().err.startswith("error: CUDA is not available")


def test_fixed_weight_planes_of_a_resnet_name_the_landscapes_that_apply():
    with pytest.raises(UnsupportedModelError) as err:
        require_chain(build_model("resnet:20"), "fixed-weight planes")
    message = str(err.value)
    assert message.startswith("fixed-weight planes need a chain of Linear/Conv2d layers")
    assert "python -m landscape plane or line" in message and "sharpness" not in message and "measures" not in message


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _help_entries(text: str) -> dict[str, str]:
    """``--option -> its help text`` (whitespace collapsed) from an argparse ``--help`` page."""
    entries, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (-\S+)", line)
        if m:
            current = m[1].rstrip(",")
            entries[current] = line
        elif current is not None and line.startswith("   "):
            entries[current] += " " + line
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in entries.items()}


def _spellings(value: object) -> list[str]:
    """How a help text may write a default: ``1e-06`` as ``1e-6``, ``1.0`` as ``1``, a list as its items."""
    if isinstance(value, (list, tuple)):
        return [" ".join(x for x in (_spellings(v)[-1] for v in value))]
    if isinstance(value, float):
        g = f"{value:g}"
        return [g, re.sub(r"e([+-])0*(\d)", lambda m: "e" + m[1].replace("+", "") + m[2], g)]
    return [str(value)]


HELP_PAGES = [(name, cli) for name, cli in (("sharpness", sharpness_cli), ("landscape", landscape_cli))]


@pytest.mark.parametrize("package, cli", HELP_PAGES, ids=[name for name, _ in HELP_PAGES])
def test_every_help_page_states_every_default(package, cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal: the entries are parsed across lines
    unstated = []
    for command, parser in _subcommands(cli._parser()).items():
        entries = _help_entries(parser.format_help())
        for action in parser._actions:
            default = action.default
            if not action.option_strings or default in (None, False, argparse.SUPPRESS):
                continue  # a flag, or an option whose absence means "not done" (--json, --epsilon ...)
            text = entries[action.option_strings[-1]]
            if "default" not in text or not any(s in text for s in _spellings(default)):
                unstated.append(f"{package} {command} {action.option_strings[-1]} (default {default!r}): {text}")
    assert not unstated, "\n".join(unstated)


def test_help_texts_say_what_the_issue_asked():
    sharpness_pages = _subcommands(sharpness_cli._parser())
    landscape_pages = _subcommands(landscape_cli._parser())
    kind = _help_entries(sharpness_pages["verify"].format_help())["--kind"]
    assert "(default: all," in " ".join(kind.split())
    model = _help_entries(sharpness_pages["compute"].format_help())["--model"]
    assert "16, 32 and 64 channels per stage W multiplies" in model
    plane, line = landscape_pages["plane"].format_help(), landscape_pages["line"].format_help()
    assert "--to" not in plane and "--to" in line and "41 with --to" in line
    assert "(default: plane)" in " ".join(plane.split()) and "(default: line)" in " ".join(line.split())


def test_pages_of_output_folders_side_by_side_share_one_plotly_js(tmp_path, monkeypatch):
    from landscape import _toys as toys
    from landscape._plot_plotly import PLOTLY_JS, plotly_figure, plotly_js_path, write_html

    monkeypatch.chdir(tmp_path)

    def shared(out: str, html_js: str = "directory"):
        return landscape_cli.shared_js_folder(argparse.Namespace(out=out, html_js=html_js))

    assert shared("fixed-a") == tmp_path and shared("runs/a") == tmp_path / "runs"
    assert shared(".") is None and shared(str(tmp_path.parent / "elsewhere")) is None  # nothing above the cwd
    assert shared("fixed-a", "inline") is None
    fig = plotly_figure([next(s for s in toys.fig_1_5_surfaces(steps=5) if not s.is_line)], title="t")
    written = []
    for folder in ("fixed-a", "fixed-b"):
        (tmp_path / folder).mkdir()
        written.append(write_html(fig, f"{folder}/page.html", shared_folder=shared(folder)))
    assert written == [[str(tmp_path / PLOTLY_JS), "fixed-a/page.html"], ["fixed-b/page.html"]]  # written once
    assert sorted(p.name for p in tmp_path.rglob(PLOTLY_JS)) == [PLOTLY_JS]
    for folder in ("fixed-a", "fixed-b"):
        page = (tmp_path / folder / "page.html").read_text()
        assert '<script charset="utf-8" src="../plotly.min.js"></script>' in page
    # a plotly.min.js of the user's own is never replaced: the shared one falls back to beside the page, and one
    # beside the page is refused
    own = tmp_path / "own"
    (own / "run").mkdir(parents=True)
    (own / PLOTLY_JS).write_text("// my own script")
    assert write_html(fig, own / "run" / "page.html", shared_folder=own)[0] == str(own / "run" / PLOTLY_JS)
    assert (own / PLOTLY_JS).read_text() == "// my own script"
    assert 'src="plotly.min.js"' in (own / "run" / "page.html").read_text()
    with pytest.raises(ValueError, match=r"own/plotly.min.js exists and is not plotly.js, so it is not replaced"):
        plotly_js_path(own)


def test_long_tensor_lists_in_degenerate_point_messages_are_cut_to_the_first_few():
    from manifolds._structure import name_list

    assert name_list([f"layer{i}.bias" for i in range(21)]) == (
        "layer0.bias, layer1.bias, layer2.bias, layer3.bias and 17 more"
    )
    assert name_list(["0.weight", "0.bias"]) == "0.weight, 0.bias"
