"""What a result may claim: the rescaling group found on the model, and what could not be measured.

A measure's [`invariant_under`][sharpness.Measure] is a general claim ("invariant under node-wise
rescaling"); on a given network it holds only for the rescalings that network has. The claim recorded in a
result is the general one intersected with the kinds whose group (restricted to the trainable parameters) has
a positive dimension, and the sentence that says what was removed and why. Skipped measures and dropped
parameters are said here too, in one style: a few words for a table cell, one sentence for the line below it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from manifolds import Pin, RescalingGroup, UnsupportedModelError
from manifolds._attention import required_symmetry
from sharpness.products._objective import Objective

KINDS = ("node", "layer")
# Invariances under the transformer symmetry's factors: claim kind -> (factor kind, what the factor is of).
# claim kind of a transformer factor -> why a network without such a factor cannot test it
FACTOR_KINDS = {
    "attention": "no attention head whose query/key or value/output basis can move was found",
    "normalization": "no normalization layer whose affine scale can be traded was found",
}


def factor_claim(factor) -> str | None:
    """The claim kind a factor of `manifolds.transformer_symmetry` belongs to: ``"attention"`` (a head's GL
    factor), ``"normalization"`` (a normalization's affine scale trade: a LayerNorm or RMSNorm module, a scale
    written by hand as ``h * w``, the query and key normalizations' scales traded against each other) or ``None``
    (token-wise units, layer scales, the GL of features read by linear layers alone: drawn with the whole group)."""
    label = factor.label
    if factor.kind == "GL":
        return "attention" if label.startswith("attention") else None
    traded = label.startswith(("affine scale", "elementwise scale")) or label.endswith("normalization scales")
    return "normalization" if traded else None


def symmetry_unknown(failure: str) -> str:
    """The reason a transformer kind cannot be tested when the factors could not be read."""
    return f"the transformer symmetry is unknown, because {failure}"


def rescaling_groups(objective: Objective) -> dict[str, RescalingGroup] | None:
    """``kind -> group`` of ``objective.model`` restricted to its trainable parameters (frozen ones stay as they
    are), or ``None`` when the group is unknown (see ``objective.structure.group_failure``)."""
    structure = objective.structure
    if structure.group is None:
        return None
    params = objective.params
    return {"node": structure.group.restricted(params), "layer": structure.layer_group.restricted(params)}


def summarize_pins(pins: Iterable[Pin]) -> list[str]:
    """The pinned channels grouped by reason: ``"<reason>: <channels> channel(s) at <places> place(s)"``."""
    by_reason: dict[str, list[int]] = {}
    for pin in pins:
        by_reason.setdefault(pin.reason, []).append(pin.channels)
    return [f"{reason}: {sum(c)} channel(s) at {len(c)} place(s)" for reason, c in by_reason.items()]


def group_summary(groups: Mapping[str, RescalingGroup] | None, failure: str | None = None) -> dict:
    """JSON-ready summary of the group a result used: ``dim`` (free node-wise scales), ``layer_dim`` (free
    layer-wise scales), ``pinned`` (what fixed the other scales, by reason) and ``unknown_operations``; with an
    unknown group, ``dim`` and ``layer_dim`` are ``None`` and ``unknown_because`` says why."""
    if groups is None:
        return {"dim": None, "layer_dim": None, "unknown_because": failure}
    node = groups["node"]
    return {
        "dim": node.dim,
        "layer_dim": groups["layer"].dim,
        "pinned": summarize_pins(node.pins),
        "unknown_operations": list(node.unknown),
    }


def describe_group(summary: Mapping) -> str:
    """One line for a command line's output: the group's dimensions and what pinned the rest."""
    if summary.get("dim") is None:
        return f"rescaling group: unknown, because {summary.get('unknown_because')}"
    pinned = "; ".join(summary["pinned"]) or "nothing"
    return (
        f"rescaling group: {summary['dim']} free node-wise scale(s), {summary['layer_dim']} layer-wise; "
        f"pinned: {pinned}"
    )


def untestable_kinds(groups: Mapping[str, RescalingGroup] | None, failure: str | None = None) -> dict[str, str]:
    """``kind -> reason`` for each rescaling kind the network does not have (a group of dimension 0, or no
    group found): an invariance under it cannot be claimed, nor checked."""
    if groups is None:
        return {kind: f"the rescaling group is unknown, because {failure}" for kind in KINDS}
    if groups["node"].dim == 0:  # the layer-wise group is a subgroup: it has dimension 0 too
        return dict.fromkeys(KINDS, "this network's rescaling group has dimension 0 (every scale is pinned)")
    if groups["layer"].dim == 0:
        return {"layer": "this network's layer-wise rescaling group has dimension 0 (no whole module can be rescaled)"}
    return {}


def untestable_factor_kinds(claimed: Iterable[str], objective: Objective) -> dict[str, str]:
    """``kind -> reason`` for each claimed invariance under a transformer factor (``"attention"``,
    ``"normalization"``) that `manifolds.transformer_symmetry` does not find on this network."""
    wanted = [kind for kind in claimed if kind in FACTOR_KINDS]
    if not wanted:
        return {}
    try:
        # the structure's own, shared by its copies; a factor moving a frozen parameter is not the measure's
        factors = required_symmetry(objective.structure).restricted(objective.params).factors
    except UnsupportedModelError as err:
        return dict.fromkeys(wanted, symmetry_unknown(first_line(err)))
    found = {factor_claim(f) for f in factors}
    return {kind: FACTOR_KINDS[kind] for kind in wanted if kind not in found}


def supported_claims(claimed: Iterable[str], untestable: Mapping[str, str]) -> tuple[tuple[str, ...], str | None]:
    """A measure's general claim ``claimed`` cut to the kinds the network has, and one sentence on what was cut
    (``None`` when nothing was)."""
    claimed = tuple(claimed)
    kept = tuple(kind for kind in claimed if kind not in untestable)
    if kept == claimed:
        return kept, None
    cut = [kind for kind in claimed if kind in untestable]
    head = "invariant under nothing here" if not kept else f"invariant under {', '.join(kept)} only"
    reasons = "; ".join(dict.fromkeys(untestable[kind] for kind in cut))
    return kept, f"{head}: {reasons}"


def symmetry_facts(claimed: tuple[str, ...], objective: Objective) -> dict:
    """What a result records about its symmetry: ``invariant_under`` (the claim that holds on this network),
    ``invariance_note`` (what was cut, when something was) and, for a measure that claims any invariance,
    ``group`` (`group_summary`)."""
    if not claimed:
        return {"invariant_under": []}
    groups = rescaling_groups(objective)
    failure = objective.structure.group_failure
    untestable = {**untestable_kinds(groups, failure), **untestable_factor_kinds(claimed, objective)}
    kept, note = supported_claims(claimed, untestable)
    facts = {"invariant_under": list(kept), "group": group_summary(groups, failure)}
    return facts if note is None else {**facts, "invariance_note": note}


def skip_entry(err: UnsupportedModelError) -> dict:
    """How a skipped measure is recorded: ``skipped`` (the error's first line, one sentence) and
    ``skip_reason`` (a few words for a table cell)."""
    return {"skipped": first_line(err), "skip_reason": getattr(err, "short", "does not apply")}


# Characters of a skip reason shown under a table; the whole reason is in the JSON output.
SKIP_REASON_CHARS = 100


def skip_notes(skipped: Mapping[str, Mapping], where: str) -> tuple[dict[str, str], list[str]]:
    """Table tags and the lines under the table for skipped measures, so that no reason (often hundreds of
    characters, naming every tensor) stretches a table: measures skipped for the same reason share a number.

    Args:
        skipped: ``name -> entry`` with ``skipped`` (the reason, one sentence) and ``skip_reason`` (a few words).
        where: where the whole reasons are, e.g. ``'measures.NAME.skipped in out.json'``.

    Returns:
        ``name -> "skipped (n)"`` for the table cells, and one line per distinct reason, ``"skipped (n) names: few
        words; the reason's beginning ..."``, then one line pointing to ``where`` (none when nothing was skipped).
    """
    groups: dict[str, list[str]] = {}
    for name, entry in skipped.items():
        groups.setdefault(entry.get("skip_reason") or "does not apply", []).append(name)
    tags, lines = {}, []
    for n, (short, names) in enumerate(groups.items(), start=1):
        tags.update(dict.fromkeys(names, f"skipped ({n})"))
        reason = clip(lower_first(skipped[names[0]]["skipped"]), SKIP_REASON_CHARS)
        lines.append(f"skipped ({n}) {', '.join(names)}: {short}; {reason}")
    if lines:
        lines.append(f"whole reasons: {where}")
    return tags, lines


def clip(text: str, limit: int) -> str:
    """``text`` cut at a word boundary to at most about ``limit`` characters, ``...`` marking the cut."""
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."


def detail_lines(name: str, entry: Mapping) -> list[str]:
    """The lines under a table for one measure, one sentence each, in one style (``"<name>: <what>: ..."``):
    why it was skipped, which parameters it left out, and which of its invariances this network lacks."""
    lines = [f"{name}: skipped: {entry['skipped']}"] if entry.get("skipped") else []
    lines += [f"{name}: {entry[key]}" for key in ("dropped", "invariance_note") if entry.get(key)]
    return lines


def lower_first(text: str) -> str:
    """``text`` with a capitalized first word in lower case (``"Cannot build"`` -> ``"cannot build"``), for a
    message that follows ``error:`` or a semicolon; names and acronyms (``"X has"``, ``"CUDA"``) stay."""
    return text[0].lower() + text[1:] if len(text) > 1 and text[0].isupper() and text[1].islower() else text


def first_line(err: BaseException) -> str:
    """The first line of ``err``'s message (its type name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
