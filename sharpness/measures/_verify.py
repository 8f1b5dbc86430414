"""Invariance verification: recompute every sharpness measure on randomly rescaled copies of a network.

A positive rescaling of hidden units (node-wise) or of whole layers (layer-wise) leaves a ReLU
network's function unchanged, so a measure of the function's sharpness should not move. The
Euclidean top eigenvalue does (Dinh et al. 2017), the layer-wise quotient measure of Rangamani et al.
is invariant under layer-wise rescaling only, and the node-wise quotient measure under both.
[`verify_invariance`][sharpness.verify_invariance] checks each registered measure against the invariances it claims
([`Measure.invariant_under`][sharpness.Measure]) and prints the table of Tables 2-3 of the flatness paper.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from manifolds import UnsupportedModelError, analyze, functional_call
from sharpness._progress import progress_bar, progress_phase
from sharpness._results import jsonable, write_text_atomic
from sharpness.measures._ball_rows import ball_rows
from sharpness.measures._claims import (
    describe_group,
    detail_lines,
    group_summary,
    skip_entry,
    supported_claims,
)
from sharpness.measures._draws import ALL_KINDS, Draws, general_claim
from sharpness.measures._measure import Measure
from sharpness.measures._registry import MEASURES, get_measure
from sharpness.products._data import ChunkedData
from sharpness.products._objective import Objective, eval_mode
from sharpness.solvers._solve import Solver

KINDS = ALL_KINDS  # node, layer, attention, normalization, group: see sharpness.measures._draws
# "unresolved": the values agree within the noise floor, but that floor is above RESOLVABLE, so the dtype cannot tell
VERDICTS = ("invariant", "changes", "FAILED", "unresolved")
# What a whole report says: every claimed invariance held, one did not, or no claim could be checked.
OUTCOMES = ("passed", "FAILED", "nothing to verify")


def _output_tolerance(dtype: torch.dtype) -> float:
    """Largest relative output change a rescaled copy may show before it counts as a different function."""
    # float64 rounding of a rescaled forward pass stays near 1e-15; 1e-6 leaves room for deep nets.
    return 1e-6 if dtype == torch.float64 else 1e-3


# A noise floor above this is no check: a measure that is not invariant changes by O(1) under log-std 1 rescalings.
RESOLVABLE = 1e-2


def rounding_floor(dtype: torch.dtype, n: int) -> float:
    """Relative rounding error of one computed top eigenvalue: ``sqrt(n) * eps`` of ``dtype``.

    The eigenvalue is a Rayleigh quotient ``v^T H v`` of a Hessian-vector product accumulated over the ``n``
    parameters; with independent rounding errors a sum of ``n`` terms is off by about ``sqrt(n)`` rounding units
    relative to its size, not the worst case ``n`` (Higham and Mary, "A new approach to probabilistic rounding
    error analysis", SIAM J. Sci. Comput. 2019). Measured: 1e-6 for a float32 MLP on digits (26k parameters,
    floor 1.9e-5); 1e-5 to 6e-5 reported for a float32 ResNet-20 in issue 36 (270k, floor 6.2e-5 per eigenvalue).

    Args:
        dtype: the evaluation dtype.
        n: the number of parameters (the operator's size).

    Returns:
        The floor, relative to the eigenvalue (2.2e-16 * sqrt(n) in float64, 1.2e-7 * sqrt(n) in float32).
    """
    return math.sqrt(max(n, 1)) * torch.finfo(dtype).eps


# The rounding-perturbed copy's change is one draw of the noise a rescaled copy shows, so the floor takes a multiple:
# reproducing the flatness paper's tables, float32 changes of rescaled copies stayed within 4x such a floor.
JITTER_FACTOR = 4.0


def _rounding_jitter(obj: Objective, measures: tuple[Measure, ...], original: Mapping[str, tuple[float, ...]], k: int,
                     solver: Solver, seed: int, progress: bool | None) -> dict[str, float]:  # fmt: skip
    """``metric -> relative change`` of each measure at a copy of the weights perturbed by one rounding unit (each
    weight times ``1 + eps z``, ``z`` standard normal), below float64 only (the caller passes the measures that
    claim an invariance here).

    A rescaled copy in a short dtype is not the same function to the last bit: its weights are rounded, and at a
    ReLU or max-pool input within rounding of its kink the branch taken can flip, which moves the Hessian far more
    than ``sqrt(n) eps`` (a float32 LeNet: 2e-4). This measures that sensitivity directly, for one more solve per
    measure. In float64 it is far below any useful ``rtol`` and not measured (``{}``).
    """
    if obj.dtype == torch.float64:
        return {}
    generator = torch.Generator().manual_seed(seed + 1)  # the same draw on every process of a group
    eps = torch.finfo(obj.dtype).eps
    nudged = obj.with_params({
        name: p * (1 + eps * torch.randn(p.shape, generator=generator, dtype=torch.float64)).to(p)
        for name, p in obj.params.items()
    })  # fmt: skip
    jitter = {}
    for measure in measures:
        with progress_phase(f"measuring a rounding-perturbed copy ({measure.name})", progress):
            result = measure.solve(nudged, k, solver, progress=progress)
        jitter[measure.name] = relative_difference(original[measure.name], _as_floats(result.eigenvalues))
    return jitter


def _solve_error(eigenvalues: Tensor, residuals: Tensor, floor: float) -> float:
    """Absolute error bound of the top ``k`` eigenvalues of one solve: the largest eigenpair residual
    ``||A v - theta v||`` (a symmetric operator has an eigenvalue within it of ``theta``), at least the rounding
    ``floor`` (relative to the largest ``|theta|``: rounding is relative to the operator's size, not to each value)."""
    values = eigenvalues.double().abs().cpu()
    return max(float((residuals.double().cpu() * values).max()), floor * float(values.max()))


def relative_difference(original: Tensor | list[float], rescaled: Tensor | list[float]) -> float:
    """``max_i |rescaled_i - original_i| / max_j |original_j|`` over the ``k`` top eigenvalues.

    For ``k = 1`` this is the flatness paper's ``|sigma' - sigma| / sigma``; for ``k > 1`` every
    eigenvalue is compared on the scale of the largest, so near-zero eigenvalues do not blow it up.

    Returns:
        A float ``>= 0``; ``inf`` when the original values are all 0 and the rescaled ones are not.
    """
    a = torch.as_tensor(original, dtype=torch.float64)
    b = torch.as_tensor(rescaled, dtype=torch.float64)
    change = float((b - a).abs().max())
    scale = float(a.abs().max())
    if scale == 0.0:
        return 0.0 if change == 0.0 else math.inf
    return change / scale


@torch.no_grad()
def _output_difference(original: Objective, rescaled: Objective) -> float:
    """Max relative difference of the two objectives' model outputs over the whole data set.

    Both outputs are computed from the same chunk, so shuffling data loaders compare like with like.
    """
    largest = torch.zeros(2, dtype=torch.float64, device=original.device)  # the change and the size, read once
    with eval_mode(original.model):
        for x, _, _ in original.chunks():
            out = functional_call(original.model, (original.params, original.buffers), (x,))
            twin = functional_call(rescaled.model, (rescaled.params, rescaled.buffers), (x,))
            chunk = torch.stack([(twin - out).abs().max(), out.abs().max()]).double()
            torch.maximum(largest, chunk, out=largest)
    change, size = original.comm.max_(largest).tolist()
    if size == 0.0:
        return 0.0 if change == 0.0 else math.inf
    return change / size


def _as_floats(values: Iterable) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class InvarianceReport:
    """Sharpness measures at a network and at randomly rescaled, function-identical copies of it.

    Attributes:
        metrics: measured metrics, in registry order.
        kinds: rescaling kinds applied (``"node"``, ``"layer"``): those asked for that this network has.
        claims: ``metric -> kinds`` the metric claims invariance under here: ``Measure.invariant_under`` cut to
            the rescalings this network has.
        original: ``metric -> (k,)`` top eigenvalues at the given parameters, largest first.
        rescaled: ``metric -> kind -> (trials, k)`` top eigenvalues at the rescaled copies.
        relative_differences: ``metric -> kind -> (trials,)`` `relative_difference` of each copy.
        output_differences: ``kind -> (trials,)`` max relative difference of the copies' outputs from
            the original's over the data set (rounding only: the copies compute the same function).
        converged: ``metric -> whether every eigen-solve of that metric met tol``.
        rtol: relative difference up to which a metric counts as invariant, asked for; raised per row to the
            noise floor where the dtype or the solver cannot resolve it (see ``noise``).
        trials: rescaled copies per kind.
        scale: standard deviation of the log rescaling factors.
        k: eigenvalues compared per measure.
        seed: seed of the rescalings.
        dtype: evaluation dtype (``"float64"``).
        method: eigen-solver.
        tol: eigen-solver tolerance used: the one asked for, raised to ``rounding`` where it was below (see
            ``tol_asked``).
        skipped: ``metric -> reason`` (one sentence) for registered metrics that do not apply to this model or
            at these weights.
        seconds: wall time of the whole check.
        skip_reasons: ``metric -> a few words`` for each skipped metric (a table cell).
        skipped_kinds: ``kind -> reason`` for each kind asked for that was not applied: the network's group of
            that kind has dimension 0 (or is unknown), so a copy would be the network itself.
        claim_notes: ``metric -> sentence`` for each metric whose general claim was cut (see ``claims``).
        group: the rescaling group the copies were drawn from (``dim``, ``layer_dim``, ``pinned`` ...; see
            `sharpness.measures._claims.group_summary`).
        noise: ``metric -> kind -> relative noise floor``: the largest, over the copies, of the two compared
            eigenvalues' error bounds (each its residual ``||A v - theta v||``, at least ``rounding``), summed and
            divided by the original top eigenvalue. A difference below it cannot be told from rounding and solver
            error; the row's tolerance is ``max(rtol, noise)`` (`tolerance`). At least `JITTER_FACTOR`
            times ``jitter``.
        rounding: `rounding_floor` of one eigenvalue in ``dtype`` for this network.
        tol_asked: the eigen-solver tolerance asked for (``tol`` where it was not raised).
        jitter: ``metric -> relative change`` at a copy of the weights perturbed by one rounding unit, for the metrics
            that claim an invariance here (below float64 only; ``{}`` in float64): ``noise`` is at least
            `JITTER_FACTOR` times it.
    """

    metrics: tuple[str, ...]
    kinds: tuple[str, ...]
    claims: dict[str, tuple[str, ...]]
    original: dict[str, tuple[float, ...]]
    rescaled: dict[str, dict[str, tuple[tuple[float, ...], ...]]]
    relative_differences: dict[str, dict[str, tuple[float, ...]]]
    output_differences: dict[str, tuple[float, ...]]
    converged: dict[str, bool]
    rtol: float
    trials: int
    scale: float
    k: int
    seed: int
    dtype: str
    method: str
    tol: float
    skipped: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    skip_reasons: dict[str, str] = field(default_factory=dict)
    skipped_kinds: dict[str, str] = field(default_factory=dict)
    claim_notes: dict[str, str] = field(default_factory=dict)
    group: dict = field(default_factory=dict)
    noise: dict[str, dict[str, float]] = field(default_factory=dict)
    rounding: float = 0.0
    tol_asked: float | None = None
    jitter: dict[str, float] = field(default_factory=dict)

    def tolerance(self, metric: str, kind: str) -> float:
        """Relative difference up to which ``metric`` counts as unchanged under ``kind``: ``max(rtol, noise)``."""
        return max(self.rtol, self.noise.get(metric, {}).get(kind, 0.0))

    def resolvable(self, metric: str, kind: str) -> bool:
        """Whether the row's noise floor is small enough (at most `RESOLVABLE`) for a verdict of invariance."""
        return self.noise.get(metric, {}).get(kind, 0.0) <= RESOLVABLE

    def max_relative_difference(self, metric: str, kind: str) -> float:
        """Largest relative difference of ``metric`` over the copies rescaled by ``kind``."""
        return max(self.relative_differences[metric][kind])

    def claims_invariance(self, metric: str, kind: str) -> bool:
        """Whether ``metric`` claims invariance under ``kind`` rescalings."""
        return kind in self.claims[metric]

    def verdict(self, metric: str, kind: str) -> str:
        """``"invariant"`` (within `tolerance`), ``"changes"`` (not claimed invariant, and changed),
        ``"FAILED"`` (claimed invariant, but changed beyond `tolerance`) or ``"unresolved"`` (within the
        noise floor, but that floor is above `RESOLVABLE`: the dtype or the solver cannot tell)."""
        if self.max_relative_difference(metric, kind) <= self.tolerance(metric, kind):
            return "invariant" if self.resolvable(metric, kind) else "unresolved"
        return "FAILED" if self.claims_invariance(metric, kind) else "changes"

    @property
    def verdicts(self) -> dict[str, dict[str, str]]:
        """``metric -> kind -> verdict``."""
        return {m: {kind: self.verdict(m, kind) for kind in self.kinds} for m in self.metrics}

    @property
    def checked(self) -> tuple[tuple[str, str], ...]:
        """The ``(metric, kind)`` pairs whose claimed invariance was put to the test (an ``"unresolved"`` one was
        not: the dtype could not tell)."""
        return tuple((m, kind) for m in self.metrics for kind in self.kinds
                     if self.claims_invariance(m, kind) and self.verdict(m, kind) != "unresolved")  # fmt: skip

    @property
    def outcome(self) -> str:
        """``"FAILED"`` (a metric changed under a rescaling it claims invariance under), ``"nothing to verify"``
        (no claimed invariance could be tested: no rescaling kind applied, no measured metric claims one, or the
        dtype could not resolve any) or
        ``"passed"``."""
        if any(self.verdict(m, kind) == "FAILED" for m, kind in self.checked):
            return "FAILED"
        return "passed" if self.checked else "nothing to verify"

    @property
    def passed(self) -> bool:
        """True when at least one claimed invariance was tested and none changed (see `outcome`)."""
        return self.outcome == "passed"

    @property
    def nothing_to_verify(self) -> bool:
        """True when no claimed invariance could be tested (see [`outcome`][sharpness.InvarianceReport.outcome])."""
        return self.outcome == "nothing to verify"

    def table(self) -> str:
        """The report as a fixed-width text table, one row per (metric, rescaling kind).

        Values are top eigenvalues to 4 significant digits, relative differences in scientific notation.
        """
        out_diffs = ", ".join(f"{kind} {max(self.output_differences[kind]):.1e}" for kind in self.kinds)
        lines = [
            f"Sharpness under random function-preserving rescalings ({self.trials} per kind, "
            f"log-std {self.scale:g}, {self.dtype}, top {self.k} eigenvalue{'s' if self.k > 1 else ''}, "
            f"{self.method} tol {self.tol:.1e})",
            *self.tolerance_lines(),
        ]
        if self.group:
            lines.append(describe_group(self.group))
        if self.kinds:
            lines.append(f"max relative output difference of the rescaled copies: {out_diffs}")
        lines.append("")
        header = ("metric", "rescaling", "claims invariance", "original", "min rescaled", "max rescaled",
                  "max rel diff", "tolerance", "verdict")
        rows = []
        for m in self.metrics:
            for kind in self.kinds:
                tops = [values[0] for values in self.rescaled[m][kind]]
                rows.append((
                    m,
                    kind,
                    "yes" if self.claims_invariance(m, kind) else "no",
                    f"{self.original[m][0]:.4g}",
                    f"{min(tops):.4g}",
                    f"{max(tops):.4g}",
                    f"{self.max_relative_difference(m, kind):.2e}",
                    f"{self.tolerance(m, kind):.1e}",
                    self.verdict(m, kind),
                ))
        rows.extend((m, "-", "-", "-", "-", "-", "-", "-", f"skipped: {self.skip_reasons.get(m, 'does not apply')}")
                    for m in self.skipped)  # fmt: skip
        widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
        lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        lines.append("  ".join("-" * w for w in widths))
        lines.extend("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
        lines.append("")
        lines.extend(f"{kind}-wise rescalings: skipped: {reason}" for kind, reason in self.skipped_kinds.items())
        for m in (*self.metrics, *self.skipped):
            lines.extend(detail_lines(m, {"skipped": self.skipped.get(m), "invariance_note": self.claim_notes.get(m)}))
        raised = [f"{m} under {kind} {self.tolerance(m, kind):.1e}" for m in self.metrics for kind in self.kinds
                  if self.claims_invariance(m, kind) and self.tolerance(m, kind) > self.rtol]  # fmt: skip
        if raised:
            lines.append(f"rtol {self.rtol:.0e} is below the noise floor in {self.dtype}, so these are checked to "
                         f"their floor: {', '.join(raised)} (smaller differences are not resolvable in {self.dtype}"
                         f"{'; use float64' if self.dtype != 'float64' else ''})")
        failed = [f"{m} under {kind}" for m, kind in self.checked if self.verdict(m, kind) == "FAILED"]
        loosest = max((self.tolerance(m, kind) for m, kind in self.checked), default=self.rtol)
        if failed:
            lines.append(f"FAILED: changed by more than rtol={self.rtol:.0e} (or the row's noise floor where higher) "
                         f"although claimed invariant: {', '.join(failed)}")
        elif self.checked:
            lines.append(f"passed: every claimed invariance holds to rtol={self.rtol:.0e}" + (
                f", or its row's noise floor where higher (up to {loosest:.1e})" if loosest > self.rtol else ""))
        elif any(self.verdict(m, kind) == "unresolved" for m in self.metrics for kind in self.kinds):
            lines.append(f"nothing to verify: every claimed invariance is within a noise floor above {RESOLVABLE:g}, "
                         f"not resolvable in {self.dtype}; use float64 or a tighter solver tol")
        else:
            lines.append("nothing to verify: no measured metric claims an invariance under a rescaling this network "
                         "has, so no claim was tested")
        unconverged = [m for m in self.metrics if not self.converged[m]]
        if unconverged:
            lines.append(f"warning: the eigen-solver did not reach tol for {', '.join(unconverged)}; "
                         "raise max_iter or tol")
        return "\n".join(lines)

    def tolerance_lines(self) -> list[str]:
        """What the verdicts' tolerance was and why: the header lines of `table`."""
        lines = [f"verdict tolerance per row: max(rtol {self.rtol:.0e}, noise floor), noise floor = the two "
                 f"eigenvalues' residual bounds |A v - theta v|, each at least the {self.dtype} rounding "
                 f"sqrt(n) eps = {self.rounding:.1e}"]
        if self.jitter:
            moved = ", ".join(f"{m} {v:.1e}" for m, v in self.jitter.items())
            lines.append(f"  and at least {JITTER_FACTOR:g}x the change at weights perturbed by one {self.dtype} "
                         f"rounding unit: {moved}")
        if self.tol_asked is not None and self.tol_asked < self.tol:
            lines.append(f"solver tol {self.tol_asked:.0e} asked for is below what {self.dtype} resolves; raised to "
                         f"{self.tol:.1e} (sqrt(n) eps)")
        return lines

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict:
        """JSON-serialisable form: every field, plus the verdicts, ``outcome`` and ``passed`` (non-finite floats as
        strings)."""
        return jsonable({
            "metrics": list(self.metrics),
            "kinds": list(self.kinds),
            "claims": self.claims,
            "original": self.original,
            "rescaled": self.rescaled,
            "relative_differences": self.relative_differences,
            "output_differences": self.output_differences,
            "converged": self.converged,
            "rtol": self.rtol,
            "trials": self.trials,
            "scale": self.scale,
            "k": self.k,
            "seed": self.seed,
            "dtype": self.dtype,
            "method": self.method,
            "tol": self.tol,
            "skipped": self.skipped,
            "seconds": self.seconds,
            "skip_reasons": self.skip_reasons,
            "skipped_kinds": self.skipped_kinds,
            "claim_notes": self.claim_notes,
            "group": self.group,
            "noise": self.noise,
            "rounding": self.rounding,
            "tol_asked": self.tol_asked,
            "jitter": self.jitter,
            "tolerances": {m: {kind: self.tolerance(m, kind) for kind in self.kinds} for m in self.metrics},
            "max_relative_differences": {
                m: {kind: self.max_relative_difference(m, kind) for kind in self.kinds} for m in self.metrics
            },
            "verdicts": self.verdicts,
            "outcome": self.outcome,
            "passed": self.passed,
        })

    @classmethod
    def from_dict(cls, d: Mapping) -> InvarianceReport:
        """Rebuild a report from `to_dict` output (derived entries are recomputed, not read)."""
        return cls(
            metrics=tuple(d["metrics"]),
            kinds=tuple(d["kinds"]),
            claims={m: tuple(kinds) for m, kinds in d["claims"].items()},
            original={m: _as_floats(v) for m, v in d["original"].items()},
            rescaled={
                m: {kind: tuple(_as_floats(t) for t in trials) for kind, trials in per_kind.items()}
                for m, per_kind in d["rescaled"].items()
            },
            relative_differences={
                m: {kind: _as_floats(v) for kind, v in per_kind.items()}
                for m, per_kind in d["relative_differences"].items()
            },
            output_differences={kind: _as_floats(v) for kind, v in d["output_differences"].items()},
            converged=dict(d["converged"]),
            rtol=float(d["rtol"]),
            trials=int(d["trials"]),
            scale=float(d["scale"]),
            k=int(d["k"]),
            seed=int(d["seed"]),
            dtype=str(d["dtype"]),
            method=str(d["method"]),
            tol=float(d["tol"]),
            skipped=dict(d["skipped"]),
            seconds=float(d["seconds"]),
            skip_reasons=dict(d.get("skip_reasons", {})),
            skipped_kinds=dict(d.get("skipped_kinds", {})),
            claim_notes=dict(d.get("claim_notes", {})),
            group=dict(d.get("group", {})),
            noise={m: {kind: float(v) for kind, v in per_kind.items()} for m, per_kind in d.get("noise", {}).items()},
            rounding=float(d.get("rounding", 0.0)),
            tol_asked=None if d.get("tol_asked") is None else float(d["tol_asked"]),
            jitter={m: float(v) for m, v in d.get("jitter", {}).items()},
        )

    def save_json(self, path: str | os.PathLike) -> None:
        """Write `to_dict` to ``path`` atomically (no half-written file on failure)."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2))


@dataclass(frozen=True)
class Rescalings:
    """The random function-preserving rescalings [`verify_invariance`][sharpness.verify_invariance] applies.

    Attributes:
        kinds: rescaling kinds, out of ``"node"`` (one factor per free channel class of the model's rescaling
            group), ``"layer"`` (one factor per free module-output class), ``"attention"`` (a random ``GL(h)``
            per attention head and side), ``"normalization"`` (normalization scale trades) and ``"group"`` (an
            element of the whole group at once; `sharpness.measures._draws`); ``None`` (default): node and
            layer, and each of the others this network has.
        trials: rescaled copies per kind.
        scale: standard deviation of the log factors (1.0 gives factors of about e^{+-1}).
        seed: seed of the factors.

    Raises:
        ValueError: an unknown or repeated kind, ``trials < 1`` or a negative or non-finite ``scale``.
    """

    kinds: tuple[str, ...] | None = None
    trials: int = 5
    scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kinds is None:
            kinds = None
        else:
            kinds = self._kinds()
        object.__setattr__(self, "kinds", kinds)
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise ValueError(f"trials must be a positive integer, got {self.trials!r}")
        if not (isinstance(self.scale, (int, float)) and 0.0 <= self.scale < math.inf):
            raise ValueError(f"scale must be a non-negative finite log-std, got {self.scale!r}")

    def _kinds(self) -> tuple[str, ...]:
        kinds = (self.kinds,) if isinstance(self.kinds, str) else tuple(self.kinds)
        unknown = [kind for kind in kinds if kind not in KINDS]
        if unknown or not kinds or len(set(kinds)) != len(kinds):
            raise ValueError(f"kinds must be distinct rescaling kinds out of {', '.join(KINDS)}, got {self.kinds!r}")
        return kinds


def verify_invariance(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: object,
    metrics: str | Measure | Iterable[str | Measure] | None = None,
    *,
    rescalings: Rescalings | None = None,
    k: int = 1,
    rtol: float = 1e-6,
    solver: Solver | None = None,
    dtype: torch.dtype = torch.float64,
    progress: bool | None = None,
    distributed: bool | dist.ProcessGroup = False,
    balls: float | None = None,
) -> InvarianceReport:
    """Recompute every sharpness measure on random function-preserving rescalings of ``model``.

    For each kind in ``rescalings.kinds`` and each of ``rescalings.trials`` copies, a random element of the
    model's exact rescaling group is drawn (the kinds ``"attention"``, ``"normalization"`` and ``"group"`` draw
    from the whole group of `manifolds.NetworkStructure.symmetry` instead: see
    `sharpness.measures._draws`) (`manifolds.analyze`: i.i.d. normal log-scales with std
    ``rescalings.scale``, one per free class of channels for ``"node"``, one per module-output class for
    ``"layer"``; residual connections tie scales, BatchNorm pins its input) and applied to the parameters in
    ``dtype`` (as `manifolds.random_rescale` does, but after the cast, so a float32 model is rescaled
    without float32 rounding). Each copy is checked to compute the same outputs on the data, then every
    measure's top ``k`` eigenvalues are recomputed and compared with the original ones. ``print(report)``
    shows the table of Tables 2-3 of the flatness paper.

    Args:
        model: as for [`Objective`][sharpness.Objective]; ``model`` is never modified.
        loss_fn: as for [`Objective`][sharpness.Objective]; ``model`` is never modified.
        data: as for [`Objective`][sharpness.Objective]; ``model`` is never modified.
        metrics: measures (names in `MEASURES` or `Measure` objects); ``None`` measures every
            registered measure that applies to the model (one that raises
            `manifolds.UnsupportedModelError` at the original parameters, or its subclass
            `manifolds.DegeneratePointError`, is listed in ``skipped`` with its reason).
        rescalings: the copies to make (default ``Rescalings()``: 5 node-wise and 5 layer-wise, log-std 1).
        k: eigenvalues compared per measure.
        rtol: relative difference up to which a measure counts as unchanged.
        solver: eigen-solver settings (default ``Solver(tol=1e-10)``: tight, so solver error stays far
            below ``rtol``).
        dtype: evaluation dtype; float64 keeps rounding well below ``rtol``.
        progress: progress of every solve and over the (kind, trial) pairs: ``None``, bars on a terminal and phase
            lines on standard error without one (see `sharpness.io.progress_bar`); ``False``: nothing.
        distributed: share the data among the processes of a ``torch.distributed`` group (see
            `Objective`); the rescalings are process 0's.
        balls: a radius ``rho``: also recompute second-order geodesic sharpness on the symmetry measure's metric
            (row ``geodesic``, claims the whole group) and adaptive sharpness (row ``adaptive``, claims the
            entry-wise scalings only) at it, each a worst loss increase instead of an eigenvalue (see
            `sharpness.measures._ball_rows`).

    Only rescalings the network has are drawn: a kind whose group (restricted to the trainable parameters) has
    dimension 0 is left out (``skipped_kinds``), and a measure's claim is cut to the kinds left (``claims``,
    ``claim_notes``), so a claim is only ever checked against a rescaling that moves the parameters. When no
    claim is left to check (a GELU network: its group has dimension 0), no measure is computed and the report's
    [`outcome`][sharpness.InvarianceReport.outcome] is ``"nothing to verify"``. A measure that does not exist at these
    weights (`manifolds.DegeneratePointError`: a dead unit for ``"minnorm"``, a zero-norm tensor for
    ``"layer"`` ...) is skipped like one that does not apply to the model, unless it was asked for.

    Returns:
        The `InvarianceReport`; ``.outcome`` says whether every claimed invariance held (``"passed"``),
            one did not (``"FAILED"``) or none could be tested (``"nothing to verify"``); ``.passed`` is True for
            the first only.

    Raises:
        UnsupportedModelError: positive rescaling is not a symmetry of ``model`` (the message names the
            offending module), or a rescaled copy computes different outputs (an operation the
            structure analysis did not see).
        ValueError: an unknown measure, an empty list of measures, or a ``rtol`` that is not positive.
    """
    started = time.perf_counter()
    rescalings = rescalings or Rescalings()
    solver = solver or Solver(tol=1e-10)
    if not (isinstance(rtol, (int, float)) and 0.0 < rtol < math.inf):
        raise ValueError(f"rtol must be a positive number, got {rtol!r}")
    explicit = metrics is not None
    if metrics is None:
        measures = tuple(MEASURES.values())
    elif isinstance(metrics, (str, Measure)):
        measures = (get_measure(metrics),)
    else:
        measures = tuple(get_measure(m) for m in metrics)
    if not measures:
        raise ValueError("metrics is empty; name at least one of " + ", ".join(MEASURES))
    if balls is not None:
        measures = (*measures, *ball_rows(balls))
    names = tuple(m.name for m in measures)
    if len(set(names)) != len(names):
        raise ValueError(f"metrics names a measure twice: {', '.join(names)}")

    # Refuse a model without the symmetry before any evaluation (a one-shot iterator is read once here).
    data = ChunkedData(data)
    structure = analyze(model, example_input=data.first_batch()[0])
    structure.require_group("the invariance table of random function-preserving rescalings")
    obj = Objective(model, loss_fn, data, dtype=dtype, structure=structure, distributed=distributed)
    # frozen parameters must stay as they are: only the elements that leave them alone are drawn
    draws = Draws(structure, obj.params, rescalings.kinds)
    groups = draws.groups

    # a kind whose group has dimension 0 would "rescale" by the identity: a check that cannot fail
    untestable = draws.untestable
    skipped_kinds = {kind: untestable[kind] for kind in draws.kinds if kind in untestable}
    kinds, trials = tuple(kind for kind in draws.kinds if kind not in untestable), rescalings.trials

    # Neither the solver nor the verdict can resolve less than rounding: a tolerance below it is raised to it.
    rounding = rounding_floor(obj.dtype, obj.layout.size)
    tol_asked = solver.tol
    if solver.tol < rounding:
        solver = dataclasses.replace(solver, tol=rounding)

    original: dict[str, tuple[float, ...]] = {}
    errors: dict[str, float] = {}  # absolute error bound of each original solve
    converged: dict[str, bool] = {}
    skipped: dict[str, dict] = {}
    for measure in measures if kinds else ():
        try:
            with progress_phase(f"measuring original model ({measure.name})", progress):
                result = measure.solve(obj, k, solver, progress=progress)
        except UnsupportedModelError as err:
            if explicit:
                raise
            skipped[measure.name] = skip_entry(err)
            continue
        original[measure.name] = _as_floats(result.eigenvalues)
        errors[measure.name] = _solve_error(result.eigenvalues, result.residuals, rounding)
        converged[measure.name] = result.converged
    measured = tuple(m for m in measures if m.name in original)
    claims = {m.name: supported_claims(general_claim(m.invariant_under), untestable) for m in measured}
    claiming = tuple(m for m in measured if claims[m.name][0])  # the others have no verdict of invariance to guard
    jitter = _rounding_jitter(obj, claiming, original, k, solver, rescalings.seed, progress)

    generator = torch.Generator().manual_seed(rescalings.seed)
    rescaled: dict[str, dict[str, list[tuple[float, ...]]]] = {m.name: {kind: [] for kind in kinds} for m in measured}
    noise: dict[str, dict[str, float]] = {m.name: {kind: 0.0 for kind in kinds} for m in measured}
    output_differences: dict[str, list[float]] = {kind: [] for kind in kinds}
    limit = _output_tolerance(obj.dtype)
    with progress_bar(len(kinds) * trials, "rescaled copies", progress) as bar:
        for kind in kinds:
            bar.set_postfix(kind=kind, refresh=False)
            for trial in range(trials):
                twin = obj.with_params(draws.draw(kind, obj.params, rescalings.scale, generator, obj.comm.broadcast_))
                difference = _output_difference(obj, twin)
                if not difference <= limit:
                    raise UnsupportedModelError(
                        f"the {kind}-wise rescaled copy {trial} changes the model's outputs by {difference:.1e} "
                        f"(relative, more than {limit:.0e}), so rescaling is not a symmetry of "
                        f"{type(model).__name__}; it likely applies an operation (e.g. a functional "
                        "activation) that the structure analysis could not see"
                    )
                output_differences[kind].append(difference)
                for measure in measured:
                    with progress_phase(f"{kind}-wise copy {trial + 1}/{trials} ({measure.name})", progress):
                        result = measure.solve(twin, k, solver, progress=progress)
                    rescaled[measure.name][kind].append(_as_floats(result.eigenvalues))
                    both = errors[measure.name] + _solve_error(result.eigenvalues, result.residuals, rounding)
                    scale = max(abs(v) for v in original[measure.name])
                    floor = max(both / scale if scale > 0 else math.inf, JITTER_FACTOR * jitter.get(measure.name, 0.0))
                    noise[measure.name][kind] = max(noise[measure.name][kind], floor)
                    converged[measure.name] = converged[measure.name] and result.converged
                bar.update(1)

    return InvarianceReport(
        metrics=tuple(m.name for m in measured),
        kinds=kinds,
        claims={name: kept for name, (kept, _) in claims.items()},
        original=original,
        rescaled={m: {kind: tuple(v) for kind, v in per_kind.items()} for m, per_kind in rescaled.items()},
        relative_differences={
            m: {kind: tuple(relative_difference(original[m], v) for v in per_kind[kind]) for kind in kinds}
            for m, per_kind in rescaled.items()
        },
        output_differences={kind: tuple(v) for kind, v in output_differences.items()},
        converged=converged,
        rtol=float(rtol),
        trials=trials,
        scale=float(rescalings.scale),
        k=k,
        seed=rescalings.seed,
        dtype=str(obj.dtype).removeprefix("torch."),
        method=solver.method,
        tol=float(solver.tol),
        skipped={name: entry["skipped"] for name, entry in skipped.items()},
        seconds=time.perf_counter() - started,
        skip_reasons={name: entry["skip_reason"] for name, entry in skipped.items()},
        skipped_kinds=skipped_kinds,
        claim_notes={name: note for name, (_, note) in claims.items() if note},
        group={**group_summary(groups), **draws.summary()},
        noise=noise,
        rounding=rounding,
        tol_asked=float(tol_asked),
        jitter=jitter,
    )
