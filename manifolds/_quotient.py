"""Quotient geometries of the rescaling symmetry: layer-wise and node-wise metrics.

Both classes work on flat vectors of length ``n`` (see [`manifolds.ParamLayout`][manifolds.ParamLayout]) at a fixed
point ``w`` and share one vocabulary (geoopt / pymanopt style):

- ``inner(eta, xi)``, ``norm(xi)``: the metric ``g_w``;
- ``vertical_basis()``: a ``(dim_V, n)`` basis of the tangent space of the rescaling orbit;
- ``proj_horizontal(xi)``: ``g``-orthogonal projection onto the horizontal space;
- ``egrad2rgrad(egrad)``: Riemannian gradient ``G^{-1} egrad``;
- ``ehess2rhess(egrad, ehvp, xi)``: exact Riemannian Hessian-vector product from the Euclidean
  gradient and the Euclidean product ``ehvp = H xi`` (Levi-Civita terms included, so it is right
  away from critical points), projected onto the horizontal space;
- ``whiten(xi) = G^{1/2} xi`` / ``unwhiten``: in whitened coordinates the metric is Euclidean and the
  Riemannian Hessian is a symmetric matrix: ``whitened_hessian(egrad, hvp)`` returns it as a
  function, ``whitened_projection`` the matching orthogonal projection (for eigen-solvers);
- ``expmap(xi)``: the exact exponential map of the total-space metric (a second-order retraction).

Layer-wise metric (Rangamani et al., Prop. 2.3/2.5): ``g(eta, xi) = sum_B <eta_B, xi_B> / ||w_B||^2``
over blocks ``B`` = every weight and bias tensor. Invariant under layer-wise rescaling only.

Node-wise metric: ``g(eta, xi) = sum_k eta_k xi_k / w_k^2``. Euclidean in ``u = log|w|``, where
every node-wise rescaling is a translation; invariant under all positive rescalings.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor

from manifolds._layout import ParamLayout
from manifolds._node_symmetry import NodeSymmetry
from manifolds._structure import DegeneratePointError, NetworkStructure, UnsupportedModelError, name_list


class SolverHessian(NamedTuple):
    """The Riemannian Hessian as a symmetric map in the coordinates an eigen-solver runs it in (orthogonal ones: the
    whitened coordinates up to a fixed orthogonal change, so the spectrum is the same).

    Attributes:
        apply: ``(v, horizontal=False, out=None) -> P M P v`` on ``(n,)`` vectors (``horizontal``: ``v`` is known to be
            horizontal, so it is not projected again; ``out``: a horizontal vector the product is added to in place).
        project: the orthogonal projection onto the horizontal space in these coordinates, ``(..., n)``.
        to_whitened: ``(..., n)`` vectors of these coordinates -> whitened coordinates.
        gradient: ``() -> (n,)``, the loss's gradient in these coordinates (its derivative along a vector ``v`` of
            them is ``<gradient(), v>``), or ``None``: what eigen-solvers may start from besides a random vector.
    """

    apply: Callable[..., Tensor]
    project: Callable[[Tensor], Tensor]
    to_whitened: Callable[[Tensor], Tensor]
    gradient: Callable[[], Tensor] | None = None


def _flat_point(point: Mapping[str, Tensor] | Tensor, layout: ParamLayout | None) -> tuple[Tensor, ParamLayout]:
    if isinstance(point, Tensor):
        if layout is None:
            raise ValueError("a flat point needs its ParamLayout")
        return point.detach(), layout
    layout = layout or ParamLayout.from_tensors(point)
    return layout.flatten({k: v.detach() for k, v in point.items()}), layout


def _orthonormal_rows(basis: Tensor) -> Tensor:
    """An orthonormal basis (rows) of the span of ``basis`` rows; directions of zero length are dropped
    (a class acting only on excluded tensors), so they never project out an arbitrary direction."""
    if not basis.shape[0]:
        return basis
    u, sigma, _ = torch.linalg.svd(basis.T, full_matrices=False)
    keep = sigma > sigma.max() * basis.shape[1] * torch.finfo(basis.dtype).eps
    return u[:, keep].T


class _Quotient(ABC):
    """Whitened-coordinate machinery shared by the two metrics (both have a diagonal ``G``).

    Entries with ``sqrt_metric == 0`` are dropped from the tangent space (zero-norm blocks excluded
    on request under the layer-wise metric, exactly-zero weights under the node-wise metric).
    """

    name: ClassVar[str]  # the key of QUOTIENTS
    invariant_under: ClassVar[tuple[str, ...]]  # rescaling kinds that are isometries of the metric
    geodesic: ClassVar[str]  # what expmap does, in one sentence for figure metadata
    layout: ParamLayout
    point: Tensor  # (n,)
    sqrt_metric: Tensor  # (n,) diagonal of G^{1/2}; 0 marks a dropped entry

    @classmethod
    @abstractmethod
    def geoopt_manifold(cls):
        """The per-tensor ``geoopt`` manifold with this metric (for `manifolds.quotient_parameters`)."""

    def geodesic_map(self, directions: Tensor, radius: float = 1.0) -> Callable[[Tensor], Tensor]:
        """``c (B, k) -> (B, n)``: the points ``Exp(sum_i c_i directions_i)`` for tangent ``directions (k, n)``
        (``radius``, the largest ``|c_i|`` asked for, matters only to quotients without a closed-form map)."""

        def points(c: Tensor) -> Tensor:
            return torch.stack([self.expmap(xi) for xi in c @ directions])

        return points

    def inner(self, eta: Tensor, xi: Tensor) -> Tensor:
        """``g_w(eta, xi)`` for flat tangent vectors ``(n,)`` (a 0-dim tensor)."""
        return torch.dot(self.whiten(eta), self.whiten(xi))

    def norm(self, xi: Tensor) -> Tensor:
        """``||xi||_g``."""
        return torch.linalg.vector_norm(self.whiten(xi))

    def whiten(self, xi: Tensor) -> Tensor:
        """``G^{1/2} xi``, ``(..., n)``: coordinates in which the metric is Euclidean."""
        return xi * self.sqrt_metric

    def dropped_entries(self) -> Tensor:
        """Sorted flat indices of the entries the metric leaves out (``sqrt_metric == 0``), ``(m,)`` int64 on the
        point's device."""
        return torch.nonzero(self.sqrt_metric == 0).reshape(-1)

    def unwhiten(self, zeta: Tensor) -> Tensor:
        """``G^{-1/2} zeta``, ``(..., n)`` (dropped entries map to 0)."""
        kept = self.sqrt_metric > 0
        return torch.where(kept, zeta / torch.where(kept, self.sqrt_metric, 1.0), 0.0)

    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        """Riemannian gradient ``G^{-1} egrad`` (horizontal whenever ``f`` is rescaling-invariant)."""
        return self.unwhiten(self.unwhiten(egrad))

    def proj_horizontal(self, xi: Tensor) -> Tensor:
        """``g``-orthogonal projection of ``xi`` ``(n,)`` onto the horizontal space."""
        return self.unwhiten(self.whitened_projection(self.whiten(xi)))

    def vertical_basis(self) -> Tensor:
        """``(dim_V, n)``: a basis of the vertical space (tangent space of the rescaling orbit)."""
        return self.unwhiten(self.whitened_vertical_basis())

    def ehess2rhess(self, egrad: Tensor, ehvp: Tensor, xi: Tensor) -> Tensor:
        """Exact Riemannian Hessian applied to a horizontal ``xi``, projected onto the horizontal space.

        Args:
            egrad: Euclidean gradient at the point, ``(n,)``.
            ehvp: Euclidean Hessian-vector product ``H xi``, ``(n,)``.
            xi: horizontal tangent vector, ``(n,)``.
        """
        return self.proj_horizontal(self.connection_hessian(egrad, ehvp, xi))

    def whitened_hessian(self, egrad: Tensor, hvp: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
        """``zeta -> P G^{1/2} Hess f[G^{-1/2} P zeta]``: the Riemannian Hessian as a symmetric map.

        Its eigenvalues on the range of `whitened_projection` are those of the Riemannian
        Hessian on the quotient; eigenvectors map back to tangent vectors with `unwhiten`.

        The map also takes ``horizontal=True``, the caller's promise that ``zeta`` is already horizontal (to
        rounding), which spares its projection (``P M P zeta = P M zeta`` then; the node quotient's ``M`` maps every
        vector into the horizontal space, so it skips the product's projection too), and ``out``, a horizontal
        ``(n,)`` vector the product is added to in place and returned (projected with it). Eigen-solvers use both on
        their own, already projected, vectors (see [`SymmetricOperator.matvec`][sharpness.SymmetricOperator.matvec]).

        Args:
            egrad: Euclidean gradient at the point, ``(n,)``.
            hvp: Euclidean Hessian-vector product on flat vectors, ``(n,) -> (n,)``, returning a new tensor (the
                node-wise map overwrites it).
        """

        def apply(zeta: Tensor, horizontal: bool = False, out: Tensor | None = None) -> Tensor:
            xi = self.unwhiten(zeta if horizontal else self.whitened_projection(zeta))
            product = self.whiten(self.connection_hessian(egrad, hvp(xi), xi))
            if out is None:
                return self.whitened_projection(product)
            return out.copy_(self.whitened_projection(out.add_(product)))

        return apply

    def solver_hessian(self, egrad: Tensor, hvp: Callable[[Tensor], Tensor],
                       hvp_into: Callable[[Tensor, Tensor], Tensor] | None = None) -> SolverHessian:  # fmt: skip
        """The Riemannian Hessian as eigen-solvers run it: `whitened_hessian` in coordinates of the quotient's choice,
        with the projection there and the map back to whitened coordinates (here: the whitened ones themselves).

        Args:
            egrad: Euclidean gradient at the point, ``(n,)``.
            hvp: Euclidean Hessian-vector product, ``(n,) -> (n,)``.
            hvp_into: optionally the same product added in place to its second argument and returned (e.g.
                [`SymmetricOperator.matvec_add`][sharpness.SymmetricOperator.matvec_add]), which a quotient may use to
                spare a vector-sized allocation per product.
        """
        # the derivative along the tangent G^-1/2 zeta is <egrad, G^-1/2 zeta> = <G^-1/2 egrad, zeta>
        return SolverHessian(self.whitened_hessian(egrad, hvp), self.whitened_projection, lambda zeta: zeta,
                             lambda: self.unwhiten(egrad))

    @abstractmethod
    def connection_hessian(self, egrad: Tensor, ehvp: Tensor, xi: Tensor) -> Tensor:
        """Total-space Riemannian Hessian ``grad_xi grad f`` (Levi-Civita), before projection."""

    @abstractmethod
    def whitened_projection(self, zeta: Tensor) -> Tensor:
        """Euclidean projection of whitened vectors ``(..., n)`` onto the whitened horizontal space."""

    @abstractmethod
    def whitened_vertical_basis(self) -> Tensor:
        """``(dim_V, n)`` basis of the whitened vertical space."""

    @abstractmethod
    def expmap(self, xi: Tensor) -> Tensor:
        """Exact exponential map of the total-space metric at the point: a flat point ``(n,)``."""


def _differentiated(t: Tensor) -> bool:
    """Whether ``t`` takes part in automatic differentiation (autograd, or a ``torch.func`` transform)."""
    return t.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(t)


class LayerScaleQuotient(_Quotient):
    """Quotient by layer-wise rescaling with the metric of Rangamani et al. (Prop. 2.3 / 2.5).

    ``g_w(eta, xi) = sum_B <eta_B, xi_B> / ||w_B||^2`` over the blocks ``B`` (each layer's weight and,
    with biases, its bias). Vertical space (Lemma 2.4 / 2.6): ``(beta_i W_i, gamma_i b_i)`` with
    ``beta_i = gamma_i - gamma_{i-1}``, ``gamma_0 = gamma_L = 0`` (dimension ``L - 1``).

    The metric is a product of conformally Euclidean blocks, so the Levi-Civita Hessian is, per block,
    ``||w_B||^2 (H xi)_B + <w_B, xi_B> g_B - <w_B, g_B> xi_B + <xi_B, g_B> w_B``. Invariant under
    layer-wise rescaling at every point; NOT under node-wise rescaling.

    Args:
        point: parameters ``{name: tensor}`` or a flat ``(n,)`` vector (then ``layout`` is needed).
        structure: `manifolds.analyze` of the network; its ``layer_group`` (one scale per module output,
            residual connections and BatchNorm included) gives the vertical space.
        layout: flat layout (default: from ``point``).
        zero_blocks: ``"error"`` (default) refuses a block of zero norm, naming it (e.g. zero-initialised
            biases), with `DegeneratePointError` (the metric does not exist there); ``"exclude"``
            drops such blocks from the tangent space (they are fixed points of every rescaling, so the
            remaining geometry is unchanged; the Hessian is restricted to the other parameters).
    """

    name = "layer"
    invariant_under = ("layer",)
    geodesic = (
        "the exact geodesic of the layer-wise metric: per tensor a cylinder R x S^(d-1) (the log-norm moves "
        "linearly, the direction turns on the sphere)"
    )

    @classmethod
    def geoopt_manifold(cls):
        from manifolds._geoopt import LayerScaleEuclidean

        return LayerScaleEuclidean()

    def __init__(
        self,
        point: Mapping[str, Tensor] | Tensor,
        structure: NetworkStructure,
        layout: ParamLayout | None = None,
        zero_blocks: str = "error",
    ):
        if structure.layer_group is None:
            raise UnsupportedModelError(
                f"Cannot build the layer-wise quotient metric: the rescaling group is unknown, because "
                f"{structure.group_failure}."
            )
        if zero_blocks not in ("error", "exclude"):
            raise ValueError(f"zero_blocks must be 'error' or 'exclude', got {zero_blocks!r}")
        self.point, self.layout = _flat_point(point, layout)
        self.structure = structure
        self.symmetry = NodeSymmetry(structure.layer_group, self.layout)
        n_blocks = len(self.layout.names)
        sizes = torch.tensor([s.numel() for s in self.layout.shapes], device=self.point.device)
        self._block_id = torch.repeat_interleave(torch.arange(n_blocks, device=self.point.device), sizes)
        norms = self._block_sum(self.point * self.point).sqrt()
        zero = [name for name, nrm in zip(self.layout.names, norms.tolist()) if nrm == 0.0]
        if zero and zero_blocks == "error":  # the metric does not exist at this point
            raise DegeneratePointError(
                f"{'tensor' if len(zero) == 1 else 'tensors'} {name_list(zero)} {'has' if len(zero) == 1 else 'have'} "
                "zero norm, so the layer-wise metric 1/||w_B||^2 is undefined "
                "there; pass zero_blocks='exclude' to leave such tensors out, or use the node-wise metric",
                short="zero-norm tensor",
            )
        self.excluded = tuple(zero)
        self.block_norms = norms  # (n_blocks,)
        inv = torch.where(norms > 0, 1.0 / torch.where(norms > 0, norms, 1.0), 0.0)
        self.sqrt_metric = inv[self._block_id]
        basis = self.whitened_vertical_basis()
        self._q = _orthonormal_rows(basis)

    def _block_sum(self, x: Tensor) -> Tensor:
        return torch.zeros(len(self.layout.names), dtype=x.dtype, device=x.device).index_add_(0, self._block_id, x)

    def whitened_vertical_basis(self) -> Tensor:
        # The orbit's tangent along log-scales c is w * (J c); every block is scaled by one factor per class.
        eye = torch.eye(self.symmetry.dim, dtype=self.point.dtype, device=self.point.device)
        return self.whiten(self.point * self.symmetry.apply(eye))

    def whitened_projection(self, zeta: Tensor) -> Tensor:
        return zeta - (zeta @ self._q.T) @ self._q

    def connection_hessian(self, egrad: Tensor, ehvp: Tensor, xi: Tensor) -> Tensor:
        w, bid = self.point, self._block_id
        sq = (self.block_norms**2)[bid]
        w_xi = self._block_sum(w * xi)[bid]
        w_g = self._block_sum(w * egrad)[bid]
        xi_g = self._block_sum(xi * egrad)[bid]
        out = sq * ehvp + w_xi * egrad - w_g * xi + xi_g * w
        return torch.where(self.sqrt_metric > 0, out, 0.0)

    def expmap(self, xi: Tensor) -> Tensor:
        """Per block, the geodesic of ``<,>/||x||^2`` (a cylinder ``R x S^{d-1}``): the log-norm moves by
        ``<x, xi>/||x||^2`` and the direction turns on the sphere by angle ``||xi_perp|| / ||x||``."""
        w, bid = self.point, self._block_id
        nrm = self.block_norms
        safe = torch.where(nrm > 0, nrm, 1.0)
        radial = self._block_sum(w * xi) / safe**2  # d log||x|| along xi
        perp = xi - radial[bid] * w
        angle = self._block_sum(perp * perp).sqrt() / safe
        direction = perp / torch.where(angle > 0, angle, 1.0)[bid]  # norm ||x|| per block, like w
        moved = torch.exp(radial)[bid] * (torch.cos(angle)[bid] * w + torch.sin(angle)[bid] * direction)
        return torch.where(self.sqrt_metric > 0, moved, w)


class NodeScaleQuotient(_Quotient):
    """Quotient by node-wise (unit- and channel-wise) rescaling with ``g_w(eta, xi) = sum eta xi / w^2``.

    In ``u = log|w|`` the metric is Euclidean and every rescaling a translation along ``range(J)``
    ([`manifolds.NodeSymmetry`][manifolds.NodeSymmetry]), so the Riemannian Hessian is exactly
    ``Hess f[xi] = w^2 (H xi) + (w g) xi`` (entry-wise), i.e. ``diag(|w|) H diag(|w|) + diag(w g)`` in
    whitened coordinates, with the rescaling directions in its kernel. Invariant under node-wise,
    channel-wise and layer-wise rescaling at every point, eigenvectors included.

    Exactly-zero weights have no log coordinate: they are dropped from the tangent space (zero row and
    column), and from the rows of ``J``, so the horizontal projection is the orthogonal one on the entries kept.

    Args:
        point: parameters ``{name: tensor}`` or a flat ``(n,)`` vector (then ``layout`` is needed).
        structure: `manifolds.analyze` of the network; its ``group`` gives the horizontal projection.
            Without a group (fx cannot trace the model) nothing is projected: the Hessian is still invariant,
            and the rescaling directions lie in its kernel, so only zero eigenvalues are affected
            (``projected`` is ``False``).
        layout: flat layout (default: from ``point``).
    """

    name = "node"
    invariant_under = ("node", "layer")
    geodesic = (
        "the exact geodesic of the node-wise metric sum xi_k^2 / w_k^2: w * exp(xi / w) entry-wise, a straight "
        "line in log|w| (zero weights stay 0)"
    )

    @classmethod
    def geoopt_manifold(cls):
        from manifolds._geoopt import LogEuclidean

        return LogEuclidean()

    def __init__(
        self,
        point: Mapping[str, Tensor] | Tensor,
        structure: NetworkStructure,
        layout: ParamLayout | None = None,
    ):
        self.point, self.layout = _flat_point(point, layout)
        self.structure = structure
        # Zero weights have no log coordinate: J loses their rows too. J acts on log coordinates d = xi / w; the
        # whitened ones are zeta = sign(w) d, where the projection is sign(w) P sign(w).
        self.symmetry = (NodeSymmetry(structure.group, self.layout, self.point != 0)
                         if structure.group is not None else None)  # fmt: skip
        self.projected = self.symmetry is not None
        self.projection_note = (
            None
            if self.projected
            else "not projected onto the horizontal space: the rescaling group is unknown "
            f"({structure.group_failure}); the rescaling directions lie in the Hessian's kernel, so only zero "
            "eigenvalues can differ"
        )

    # `sqrt_metric` and `sign(w)` are formed on first use (each a pass and a parameter-sized vector): the
    # log-coordinate solve reads neither, and the measures count the dropped entries from `dropped_entries`.
    @functools.cached_property
    def sqrt_metric(self) -> Tensor:  # (n,) 1 / |w|, and 0 where w = 0 (1/0 = inf) or is not a number
        return self.point.abs().reciprocal_().nan_to_num_(nan=0.0, posinf=0.0)  # two passes, no temporaries

    @functools.cached_property
    def _sign(self) -> Tensor:
        return torch.sign(self.point)

    @functools.cached_property
    def _zero_entries(self) -> Tensor:
        """Sorted flat indices of the exactly-zero weights: the rows of ``J`` the symmetry left out, where it has
        them (no pass over the point), else found by one."""
        if self.symmetry is None:
            return torch.nonzero(self.point == 0).reshape(-1)
        dropped = self.symmetry._dropped  # None: nothing dropped
        return torch.zeros(0, dtype=torch.long, device=self.point.device) if dropped is None else \
            dropped.to(self.point.device)  # fmt: skip

    def dropped_entries(self) -> Tensor:
        """Sorted flat indices of the entries the metric leaves out (``sqrt_metric == 0``: zero weights, and weights
        that are not finite), ``(m,)`` int64 on the point's device."""
        return self._zero_entries if self._finite else super().dropped_entries()

    def unwhiten(self, zeta: Tensor) -> Tensor:
        """``G^{-1/2} zeta = |w| zeta``, ``(..., n)`` (dropped entries map to 0)."""
        if not self._finite or _differentiated(zeta):
            # a non-finite weight is dropped (sqrt_metric 0) where |w| zeta would not be 0; under automatic
            # differentiation (epsilon-sharpness retracts through this) the out= form is refused, and copysign's
            # derivative is 0 where zeta is, where |w| zeta's is |w|
            return super().unwhiten(zeta)
        # two passes and no sign vector: |w zeta| = |w| |zeta| exactly, with zeta's sign; w = 0 gives 0, and |w| is
        # exact where 1 / (1 / |w|) is rounded twice
        out = torch.mul(zeta, self.point)
        return torch.copysign(out, zeta, out=out)

    def _to_whitened(self, d: Tensor) -> Tensor:
        """``sign(w) d`` (log coordinates ``(..., n)`` to whitened ones) without a sign vector where the point is
        finite: ``|d|`` with the sign of ``w d`` (whose sign bit is the product's of the signs even where it
        underflows to 0), then 0 at the zero weights."""
        if not self._finite or _differentiated(d):
            return d * self._sign
        out = torch.mul(d, self.point)
        torch.copysign(d, out, out=out)
        return out.index_fill_(-1, self._zero_entries, 0.0)

    @functools.cached_property
    def _finite(self) -> bool:
        # one read-only pass, no temporary: a nan or an infinity shows in the extremes (max and min propagate nan)
        if not self.point.numel():
            return True
        low, high = torch.aminmax(self.point)
        return bool(torch.isfinite(low)) and bool(torch.isfinite(high))

    def whitened_projection(self, zeta: Tensor) -> Tensor:
        # whitened = sign(w) * (log coordinates): sign(w) P sign(w) (sign 0 drops an entry)
        if self.symmetry is None:
            return zeta
        return self._project_in_place(zeta * self._sign).mul_(self._sign)

    def whitened_vertical_basis(self) -> Tensor:
        if self.symmetry is None:
            return self.point.new_zeros(0, self.layout.size)
        eye = torch.eye(self.symmetry.dim, dtype=self.point.dtype, device=self.point.device)
        return self.symmetry.apply(eye) * self._sign

    def whitened_hessian(self, egrad: Tensor, hvp: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
        # the log-coordinate map of `solver_hessian` conjugated by sign(w): whitened = sign(w) * log coordinates
        apply_log = self._log_hessian(egrad, hvp)
        sign = self._sign

        def apply(zeta: Tensor, horizontal: bool = False, out: Tensor | None = None) -> Tensor:
            product = apply_log(zeta * sign, horizontal, None if out is None else out.mul_(sign))
            return product.mul_(sign)

        return apply

    def solver_hessian(self, egrad: Tensor, hvp: Callable[[Tensor], Tensor],
                       hvp_into: Callable[[Tensor, Tensor], Tensor] | None = None) -> SolverHessian:  # fmt: skip
        """The Riemannian Hessian in log coordinates ``d = xi / w`` (``sign(w)`` times the whitened ones), where the
        projection has no signs to apply: ``P (diag(w) H diag(w) + diag(w g)) P``, the same spectrum as
        `whitened_hessian`, at fewer passes over the parameters per product (``hvp_into``: see the base class)."""
        # the derivative along the tangent w d is <egrad, w d> = <w egrad, d>
        return SolverHessian(self._log_hessian(egrad, hvp, hvp_into), self._project_log, self._to_whitened,
                             lambda: self.point * egrad)

    def _log_hessian(self, egrad: Tensor, hvp: Callable[[Tensor], Tensor],
                     hvp_into: Callable[[Tensor, Tensor], Tensor] | None = None) -> Callable[..., Tensor]:  # fmt: skip
        """``d -> P (diag(w) H diag(w) + diag(w g)) P d = P (w (H (w d) + g d))`` in log coordinates (``horizontal`` and
        ``out`` as in `whitened_hessian`): two vectors kept for every product (``w d`` and ``H (w d) + g d``, into
        which ``hvp_into`` adds), so a product on the solvers' path allocates nothing. ``P M P = M P = P M`` here
        (the rescaling directions are in ``M``'s kernel), so a horizontal ``d`` is not projected at all; any other
        is projected before the product and after it, in place (against rounding)."""
        w, g = self.point, self.connection_factor(egrad)
        scratch: list[Tensor] = []

        def apply(d: Tensor, horizontal: bool = False, out: Tensor | None = None) -> Tensor:
            if not horizontal:
                d = self._project_log(d)
            if not scratch:
                scratch.extend((torch.empty_like(d), torch.empty_like(d)))
            x, inner = scratch
            torch.mul(w, d, out=x)
            torch.mul(g, d, out=inner)
            if hvp_into is None:
                inner.add_(hvp(x))
            else:
                hvp_into(x, inner)
            product = torch.mul(w, inner) if out is None else out.addcmul_(w, inner)
            # The Hessian of l(d) = L(w e^d) maps every rescaling direction J c to 0 (l(d + J c) = l(d)), so, being
            # symmetric, its range is horizontal: the product of a horizontal vector is horizontal up to rounding,
            # which the solvers' periodic re-projection removes. Any other vector is projected in and out.
            return product if horizontal else self._project_in_place(product)

        return apply

    def _project_log(self, d: Tensor) -> Tensor:
        """The horizontal projection in log coordinates (a new tensor)."""
        return d.clone() if self.symmetry is None else self.symmetry.project_out(d)

    def _project_in_place(self, d: Tensor) -> Tensor:
        """The horizontal projection of a contiguous log-coordinate ``d``, written over it."""
        return d if self.symmetry is None else self.symmetry.project_out(d, out=d)

    def connection_diagonal(self, egrad: Tensor) -> Tensor:
        """``w * g``: the Levi-Civita connection's term ``(w g) xi`` of the Hessian, as the diagonal it multiplies
        (``w`` times `connection_factor`)."""
        return self.point * self.connection_factor(egrad)

    def connection_factor(self, egrad: Tensor) -> Tensor:
        """``g``: the connection term's diagonal divided by ``w`` (the one place `connection_hessian`, the fused
        `whitened_hessian` and `solver_hessian` take it from)."""
        return egrad

    def connection_hessian(self, egrad: Tensor, ehvp: Tensor, xi: Tensor) -> Tensor:
        # w = 0 makes both terms 0: the dropped entries stay out
        return torch.addcmul(self.point * self.point * ehvp, self.connection_diagonal(egrad), xi)

    def expmap(self, xi: Tensor) -> Tensor:
        return self.point * torch.exp(self.whiten(xi) * self._sign)  # w exp(xi / w); zeros stay 0

    def geodesic_map(self, directions: Tensor, radius: float = 1.0) -> Callable[[Tensor], Tensor]:
        # Exp(xi) = w * exp(sign(w) G^{1/2} xi) is entry-wise with an exponent linear in xi: precompute the
        # exponent's directions, so a batch costs one product, one exp and one multiplication (equal to expmap
        # to rounding, zero weights included: their rows of G^{1/2} are 0).
        point, exponent = self.point, self.whiten(directions) * self._sign

        def points(c: Tensor) -> Tensor:
            return point * torch.exp(c @ exponent)

        return points


# name -> quotient geometry; every consumer (sharpness measures, landscape geodesics, geoopt parameters) asks here.
QUOTIENTS: dict[str, type[_Quotient]] = {cls.name: cls for cls in (LayerScaleQuotient, NodeScaleQuotient)}
