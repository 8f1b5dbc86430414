"""The exact Riemannian Hessian of any metric given as a function: Levi-Civita connection by automatic differentiation.

A metric is a function ``metric(w, xi) -> G(w) xi`` on flat vectors of length ``n``: at every point ``w`` a
symmetric positive definite linear map, differentiable in ``w``. Nothing else is derived by hand: the
connection comes from Jacobian-vector and vector-Jacobian products of that function (``torch.func``), so a
new metric (a balanced GL(h) metric for attention heads, a metric that mixes LayerNorm scales into the
layers they feed) is a few lines, not a derivation.

**The connection.** Write ``DG[a]`` for the derivative of ``w -> G(w)`` along ``a`` (a symmetric
``n x n`` matrix, never formed). The Levi-Civita connection of ``G`` has Christoffel symbols of the first
kind ``Gamma_kij = 1/2 (d_i G_kj + d_j G_ki - d_k G_ij)``; contracted with two tangent vectors this reads

    Gamma(xi, eta) = 1/2 G^-1 ( DG[xi] eta + DG[eta] xi - grad_w <xi, G(w) eta> ),

with ``<xi, G(w) eta>`` differentiated in ``w`` only (``xi``, ``eta`` held fixed). It is symmetric in
``(xi, eta)``, and on the diagonal it is ``Gamma(xi, xi) = G^-1 ( DG[xi] xi - 1/2 grad_w <xi, G(w) xi> )``:
a geodesic through ``w`` with velocity ``xi`` has acceleration ``-Gamma(xi, xi)``.

**The Hessian as a bilinear form.** The second covariant derivative of ``f`` (gradient ``g = df``,
Euclidean Hessian ``H``) is the symmetric form

    Hess f(xi, eta) = xi^T H eta - g^T Gamma(xi, eta).

So ``f(c(t)) = f + t g^T xi + t^2/2 Hess f(xi, xi) + O(t^3)`` along the geodesic, or along any curve that
agrees with it to second order, e.g. ``c(t) = w + t xi - t^2/2 Gamma(xi, xi)``
(`MetricQuotient.second_order_geodesic`; the "second-order geodesics" of geodesic sharpness).

**The Hessian as an operator.** Eigenvalues are taken relative to ``G``, so we need the ``G``-self-adjoint
map ``Hess f[xi]`` with ``<eta, G Hess f[xi]> = Hess f(xi, eta)``: ``Hess f[xi] = G^-1 (H xi - B(xi))``
where ``B(xi)`` is the covector with ``eta^T B(xi) = g^T Gamma(xi, eta)`` for every ``eta``. Put
``u = G^-1 g`` (the Riemannian gradient, computed once per point). Then
``g^T Gamma(xi, eta) = 1/2 u^T ( DG[xi] eta + DG[eta] xi - grad_w <xi, G eta> )``, and each term turns
into one product that ``torch.func`` gives:

- ``u^T DG[xi] eta = eta^T (DG[xi] u)``, as ``DG[xi]`` is symmetric: the JVP of ``w -> G(w) u`` along ``xi``;
- ``u^T DG[eta] xi = eta^T grad_w (u^T G(w) xi)``: the VJP of ``w -> G(w) xi`` with cotangent ``u``;
- ``u^T grad_w <xi, G(w) eta> = sum_k u_k d_k (xi^T G eta) = eta^T (DG[u] xi)``: the JVP of ``w -> G(w) xi``
  along ``u``.

Hence ``B(xi) = 1/2 ( DG[xi] u + grad_w(u^T G(w) xi) - DG[u] xi )``: two JVPs and one VJP of the metric
function, on top of the Euclidean product ``H xi``. At one point and one gradient ``B`` is a fixed symmetric
linear map, ``1/2 (A + A^T - DG[u])`` with ``A`` the Jacobian of ``w -> G(w) u``, so the Hessian operator
(`MetricQuotient.connection_operator`) applies ``A`` and ``A^T`` by the metric's closed forms (`Metric.jacobian`)
where it has them, else records the graph of ``G(w) u`` and of its backward pass once and applies ``A^T`` and ``A``
as backward passes through them, and ``DG[u]`` by the metric's own `Metric.derivative` where it has one (the
symmetry metric's closed forms are a few batched products per block shape). For the metrics of this package
(elementwise, per-tensor or per-block) these cost a few passes over ``n`` numbers.

**Quotient.** With a vertical space (the tangents of the group orbit, ``V`` of shape ``(n, d)``) the
quotient's Hessian at the class of ``w`` lifts to ``P Hess f[xi]`` for horizontal ``xi``, where ``P`` is
the ``G``-orthogonal projection onto the complement of ``range(V)`` (the horizontal space), provided ``f``
and ``G`` are invariant under the group. For eigen-solvers everything is moved to whitened coordinates
``zeta = W xi`` with ``W^T W = G`` (e.g. ``W = G^{1/2}``): the metric becomes Euclidean, the horizontal
space the orthogonal complement of ``range(W V)``, and ``zeta -> P_w W Hess f[W^-1 P_w zeta]``
(``= P_w W^-T (H - B) W^-1 P_w zeta``) a symmetric map whose eigenvalues are those of the quotient Hessian
relative to ``G``. ``P_w`` comes from a thin SVD of ``W V`` once per point (``O(n d^2)`` time, ``O(n d)``
memory; rank-deficient bases allowed) and costs ``O(n d)`` per application: fine for the tens to thousands
of directions of a per-layer or per-head group, not for ``d`` near ``n``, where the group's block structure
must be used instead (as [`manifolds.NodeSymmetry`][manifolds.NodeSymmetry] does for rescalings).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from manifolds._layout import ParamLayout
from manifolds._quotient import _orthonormal_rows

if TYPE_CHECKING:
    from manifolds._geodesic_ode import GeodesicMap

PointMap = Callable[[Tensor, Tensor], Tensor]  # (w (n,), v (n,)) -> (n,)


@dataclass(frozen=True)
class Metric:
    """A Riemannian metric on flat parameter vectors ``(n,)``, given as functions of the point.

    Attributes:
        apply: ``(w, xi) -> G(w) xi``, both ``(n,)``; linear in ``xi``, symmetric positive definite, and
            differentiable in ``w`` by ``torch.func`` (no in-place updates of inputs, no ``.item()``).
        solve: ``(w, v) -> G(w)^-1 v``; ``None``: from a dense factorisation of ``G(w)`` (small ``n`` only).
        whiten: ``(w, xi) -> W(w) xi`` for some ``W`` with ``W^T W = G`` (e.g. ``G^{1/2}``); with
            ``unwhiten``, or both ``None`` (then ``W = G^{1/2}`` from the dense factorisation).
        unwhiten: ``(w, zeta) -> W(w)^-1 zeta``, the inverse of ``whiten``.
        name: a short label for messages and results.
        batched: whether ``apply`` and ``solve`` also take a batch of points ``w (..., n)`` with vectors of the same
            batch shape, each vector under the metric at its own point (geodesics are then integrated for a whole
            grid at once; otherwise point by point under ``torch.func.vmap``).
        derivative: ``(w, a) -> (xi -> DG(w)[a] xi)``, the derivative of ``G`` along ``a`` as a map of ``xi``, with
            its per-point work done once; ``None``: a JVP of ``apply`` per vector (what it must equal).
        jacobian: ``(w, u) -> (xi -> A xi, eta -> A^T eta)`` with ``A`` the Jacobian of ``w -> G(w) u`` (``A xi =
            DG(w)[xi] u``, ``A^T eta = grad_w <eta, G(w) u>``), per-point work done once; ``None``: backward passes
            through a recorded graph of ``G(w) u`` (what it must equal).
    """

    apply: PointMap
    solve: PointMap | None = None
    whiten: PointMap | None = None
    unwhiten: PointMap | None = None
    name: str = "metric"
    batched: bool = False
    derivative: Callable[[Tensor, Tensor], Callable[[Tensor], Tensor]] | None = None
    jacobian: Callable[[Tensor, Tensor], tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]] | None = None

    def __post_init__(self):
        if (self.whiten is None) != (self.unwhiten is None):
            raise ValueError("give both whiten and unwhiten (inverse maps of each other), or neither")

    @classmethod
    def from_quadratic_form(cls, form: Callable[[Tensor, Tensor], Tensor], **kwargs) -> Metric:
        """The metric whose quadratic form is ``form(w, xi) = xi^T G(w) xi`` (a 0-dim tensor).

        ``G(w) xi = 1/2 grad_xi form(w, xi)``, taken by ``torch.func.grad``; ``kwargs`` as in `Metric`.
        """

        def apply(w: Tensor, xi: Tensor) -> Tensor:
            return 0.5 * torch.func.grad(lambda v: form(w, v))(xi)

        return cls(apply, **kwargs)


def layer_metric(layout: ParamLayout) -> Metric:
    """The layer-wise metric ``g(eta, xi) = sum_B <eta_B, xi_B> / ||w_B||^2`` over the tensors ``B`` of ``layout``.

    The same metric as `manifolds.LayerScaleQuotient` (every weight and every bias a block of its own),
    written as a function of ``w``. Undefined where a tensor is zero (`MetricQuotient` refuses the point).
    """
    sizes = [s.numel() for s in layout.shapes]

    def sq_norms(w: Tensor) -> Tensor:  # (n,): ||w_B||^2 of the block of each entry
        # expand + cat rather than a gather: its derivatives are per-block sums, not an index scatter
        return torch.cat([(p * p).sum().expand(p.numel()) for p in torch.split(w, sizes)])

    return Metric(
        apply=lambda w, xi: xi / sq_norms(w),
        solve=lambda w, v: v * sq_norms(w),
        whiten=lambda w, xi: xi * sq_norms(w).rsqrt(),
        unwhiten=lambda w, zeta: zeta * sq_norms(w).sqrt(),
        name="layer",
    )


def node_metric() -> Metric:
    """The node-wise metric ``g(eta, xi) = sum_k eta_k xi_k / w_k^2`` (as `manifolds.NodeScaleQuotient`).

    Undefined at a zero weight (`MetricQuotient` refuses the point; the closed-form class drops such
    entries instead).
    """
    return Metric(
        apply=lambda w, xi: xi / (w * w),
        solve=lambda w, v: v * (w * w),
        whiten=lambda w, xi: xi / w.abs(),
        unwhiten=lambda w, zeta: zeta * w.abs(),
        name="node",
        batched=True,
    )


class MetricQuotient:
    """The quotient geometry of any `Metric` at a point: connection, exact Hessian, horizontal projection.

    The vocabulary is that of [`manifolds.LayerScaleQuotient`][manifolds.LayerScaleQuotient] (``inner``, ``whiten``,
    ``proj_horizontal``, ``egrad2rgrad``, ``connection_hessian``, ``ehess2rhess``, ``whitened_hessian``,
    ``whitened_projection``), so whatever binds those to a loss and an eigen-solver binds this too.
    The metric must be invariant under the group whose orbit tangents ``vertical`` spans (check it
    numerically: nothing here can).

    Args:
        metric: the metric.
        point: the flat point ``w``, ``(n,)`` (detached).
        vertical: the vertical space at ``w``: a ``(n, d)`` basis (columns: tangents of the group orbit), a
            function ``w -> (n, d)``, or ``None`` (no group: nothing is projected).
        dense_limit: largest ``n`` for which a missing ``solve`` or ``whiten``/``unwhiten`` is built from a
            dense eigendecomposition of ``G(w)`` (``O(n^2)`` memory, ``O(n^3)`` time).

    Raises:
        ValueError: the metric is not finite at ``point`` (e.g. a zero weight under the node metric, a
            zero tensor under the layer metric), the dense fallback is needed above ``dense_limit``, the
            densely built ``G(w)`` is not positive definite, or ``vertical`` has the wrong shape.
    """

    projection_note = None  # the same attribute as the closed-form quotients: nothing to qualify here

    def __init__(
        self,
        metric: Metric,
        point: Tensor,
        vertical: Tensor | Callable[[Tensor], Tensor] | None = None,
        dense_limit: int = 4096,
    ):
        self.metric = metric
        self.point = w = point.detach()
        n = w.numel()
        if w.dim() != 1:
            raise ValueError(f"the point must be a flat vector (n,), got shape {tuple(w.shape)}")
        if not torch.isfinite(metric.apply(w, torch.ones_like(w))).all():
            raise ValueError(
                f"the {metric.name} metric is not finite at this point (a zero weight or a zero tensor where the "
                "metric divides by it); move the point or use a metric defined there"
            )
        self._solve, self._whiten, self._unwhiten = self._factors(dense_limit)
        if callable(vertical):
            vertical = vertical(w)
        if vertical is None:
            vertical = w.new_zeros(n, 0)
        if vertical.dim() != 2 or vertical.shape[0] != n:
            raise ValueError(f"the vertical basis must have shape (n, d) = ({n}, d), got {tuple(vertical.shape)}")
        # orthonormal rows spanning W V: the whitened vertical space (directions of zero length dropped)
        self._q = _orthonormal_rows(torch.stack([self.whiten(v) for v in vertical.T]) if vertical.shape[1]
                                    else w.new_zeros(0, n))
        self.vertical_dim = self._q.shape[0]

    def _factors(self, dense_limit: int) -> tuple[Callable, Callable, Callable]:
        m, w = self.metric, self.point
        if m.solve is not None and m.whiten is not None:
            return (lambda v: m.solve(w, v)), (lambda xi: m.whiten(w, xi)), (lambda z: m.unwhiten(w, z))
        n = w.numel()
        if n > dense_limit:
            raise ValueError(
                f"the {m.name} metric gives no {'solve' if m.solve is None else 'whiten/unwhiten'}, and a dense "
                f"factorisation of G(w) at n = {n} exceeds dense_limit = {dense_limit}; pass them to Metric"
            )
        dense = torch.vmap(lambda e: m.apply(w, e))(torch.eye(n, dtype=w.dtype, device=w.device))
        lam, vec = torch.linalg.eigh((dense + dense.T) / 2)
        if not lam[0] > 0:
            raise ValueError(f"the {m.name} metric is not positive definite at this point (smallest eigenvalue "
                             f"{float(lam[0]):.3g}); a metric must be positive definite everywhere it is used")
        inv = (vec / lam) @ vec.T
        root, inv_root = (vec * lam.sqrt()) @ vec.T, (vec * lam.rsqrt()) @ vec.T
        solve = (lambda v: m.solve(w, v)) if m.solve is not None else (lambda v: v @ inv)
        if m.whiten is not None:
            return solve, (lambda xi: m.whiten(w, xi)), (lambda z: m.unwhiten(w, z))
        return solve, (lambda xi: xi @ root), (lambda z: z @ inv_root)

    # -- the metric ------------------------------------------------------------------------------------------

    def inner(self, eta: Tensor, xi: Tensor) -> Tensor:
        """``g_w(eta, xi) = eta^T G(w) xi`` for tangent vectors ``(n,)`` (a 0-dim tensor)."""
        return torch.dot(eta, self.metric.apply(self.point, xi))

    def norm(self, xi: Tensor) -> Tensor:
        """``||xi||_g``."""
        return self.inner(xi, xi).clamp_min(0).sqrt()

    def whiten(self, xi: Tensor) -> Tensor:
        """``W xi`` with ``W^T W = G(w)``, ``(n,)``: coordinates in which the metric is Euclidean."""
        return self._whiten(xi)

    def unwhiten(self, zeta: Tensor) -> Tensor:
        """``W^-1 zeta``, ``(n,)``."""
        return self._unwhiten(zeta)

    def egrad2rgrad(self, egrad: Tensor) -> Tensor:
        """Riemannian gradient ``G^-1 egrad``, ``(n,)``."""
        return self._solve(egrad)

    # -- the connection --------------------------------------------------------------------------------------

    def _dmetric(self, v: Tensor, along: Tensor) -> Tensor:
        """``DG[along] v``: the derivative of ``w -> G(w) v`` along ``along``, ``(n,)``."""
        return torch.func.jvp(lambda p: self.metric.apply(p, v), (self.point,), (along,))[1]

    def _dmetric_transpose(self, v: Tensor, cotangent: Tensor) -> Tensor:
        """``grad_w <cotangent, G(w) v>``, ``(n,)``."""
        return torch.func.vjp(lambda p: self.metric.apply(p, v), self.point)[1](cotangent)[0]

    def christoffel(self, xi: Tensor, eta: Tensor | None = None) -> Tensor:
        """``Gamma(xi, eta) = 1/2 G^-1 (DG[xi] eta + DG[eta] xi - grad_w <xi, G(w) eta>)``, ``(n,)``.

        Symmetric in its arguments; ``eta=None`` gives ``Gamma(xi, xi) = G^-1 (DG[xi] xi - 1/2 grad_w
        <xi, G(w) xi>)`` with one JVP and one VJP.
        """
        if eta is None:
            return self._solve(self._dmetric(xi, xi) - 0.5 * self._dmetric_transpose(xi, xi))
        return 0.5 * self._solve(self._dmetric(eta, xi) + self._dmetric(xi, eta) - self._dmetric_transpose(eta, xi))

    def connection_covector(self, rgrad: Tensor, xi: Tensor) -> Tensor:
        """``B(xi)``, ``(n,)``: the covector with ``eta^T B(xi) = g^T Gamma(xi, eta)`` for every ``eta``.

        Args:
            rgrad: the Riemannian gradient ``u = G^-1 g``, ``(n,)``.
            xi: tangent vector, ``(n,)``.

        Returns:
            ``1/2 (DG[xi] u + grad_w(u^T G(w) xi) - DG[u] xi)``: two JVPs and one VJP of the metric.
        """
        return 0.5 * (self._dmetric(rgrad, xi) + self._dmetric_transpose(xi, rgrad) - self._dmetric(xi, rgrad))

    def connection_operator(self, rgrad: Tensor) -> Callable[[Tensor], Tensor]:
        """``xi -> B(xi)`` for one Riemannian gradient: `connection_covector` with its per-point work done once.

        ``B(xi) = 1/2 (A xi + A^T xi - DG[u] xi)`` with ``A`` the Jacobian of ``w -> G(w) u`` (``u = rgrad``): the
        terms of `connection_covector`, as ``DG[xi] u = A xi`` and ``grad_w(u^T G(w) xi) = A^T xi`` (``G`` is
        symmetric). ``A xi`` and ``A^T xi`` are the metric's closed forms (`Metric.jacobian`) where it gives them;
        otherwise the graph of ``G(w) u`` and of its backward pass are recorded once, so ``A^T xi`` is one backward
        pass and ``A xi`` one backward pass through that backward (linear in its cotangent). ``DG[u] xi`` is the
        metric's `derivative` where it gives one, else one JVP per vector.

        Args:
            rgrad: the Riemannian gradient ``u = G^-1 g``, ``(n,)``.

        Returns:
            A function of a tangent vector ``(n,)``, equal to ``connection_covector(rgrad, xi)``.
        """
        if self.metric.derivative is not None:
            along_u = self.metric.derivative(self.point, rgrad)
        else:
            def along_u(xi: Tensor) -> Tensor:
                return self._dmetric(xi, rgrad)

        if self.metric.jacobian is not None:  # closed forms of A and A^T: no graph to record or to run backwards
            forward, backward = self.metric.jacobian(self.point, rgrad)

            def closed(xi: Tensor) -> Tensor:
                return 0.5 * (forward(xi) + backward(xi) - along_u(xi))

            return closed

        with torch.enable_grad():  # the recorded graphs are what makes each product cheap, whatever the caller's mode
            w = self.point.clone().requires_grad_(True)
            gu = self.metric.apply(w, rgrad)
            cotangent = torch.zeros_like(gu, requires_grad=True)
            # A^T c, recorded as a graph in c (zero, and no graph, where G does not depend on w)
            pullback = (torch.autograd.grad(gu, w, cotangent, create_graph=True, allow_unused=True,
                                            materialize_grads=True)[0] if gu.requires_grad else torch.zeros_like(w))

        def linear(output: Tensor, wrt: Tensor, xi: Tensor) -> Tensor:
            if not output.requires_grad:
                return torch.zeros_like(xi)
            return torch.autograd.grad(output, wrt, xi, retain_graph=True, allow_unused=True, materialize_grads=True)[0]

        def apply(xi: Tensor) -> Tensor:
            return 0.5 * (linear(pullback, cotangent, xi) + linear(gu, w, xi) - along_u(xi))

        return apply

    def hessian_form(self, egrad: Tensor, xi: Tensor, eta: Tensor, ehvp_eta: Tensor) -> Tensor:
        """The Riemannian Hessian as a bilinear form: ``xi^T H eta - g^T Gamma(xi, eta)`` (0-dim).

        Args:
            egrad: Euclidean gradient ``g``, ``(n,)``.
            xi: tangent vectors, ``(n,)``.
            eta: tangent vectors, ``(n,)``.
            ehvp_eta: the Euclidean product ``H eta``, ``(n,)``.
        """
        return torch.dot(xi, ehvp_eta) - torch.dot(egrad, self.christoffel(xi, eta))

    def connection_hessian(self, egrad: Tensor, ehvp: Tensor, xi: Tensor, rgrad: Tensor | None = None) -> Tensor:
        """Total-space Riemannian Hessian ``Hess f[xi] = G^-1 (H xi - B(xi))`` (``G``-self-adjoint), ``(n,)``.

        Args:
            egrad: Euclidean gradient ``g``, ``(n,)``.
            ehvp: Euclidean product ``H xi``, ``(n,)``.
            xi: tangent vector, ``(n,)``.
            rgrad: ``G^-1 g`` if already known (spares one solve).
        """
        rgrad = self._solve(egrad) if rgrad is None else rgrad
        return self._solve(ehvp - self.connection_covector(rgrad, xi))

    # -- the quotient ----------------------------------------------------------------------------------------

    def whitened_projection(self, zeta: Tensor) -> Tensor:
        """Orthogonal projection of whitened vectors ``(..., n)`` onto the whitened horizontal space."""
        if not self.vertical_dim:
            return zeta
        return zeta - (zeta @ self._q.T) @ self._q

    def whitened_vertical_basis(self) -> Tensor:
        """``(d', n)``: an orthonormal basis (rows) of the whitened vertical space ``range(W V)``."""
        return self._q

    def vertical_basis(self) -> Tensor:
        """``(d', n)``: a basis (rows) of the vertical space, ``G``-orthonormal."""
        return torch.stack([self.unwhiten(q) for q in self._q]) if self.vertical_dim else self._q

    def proj_horizontal(self, xi: Tensor) -> Tensor:
        """``G``-orthogonal projection of ``xi`` ``(n,)`` onto the horizontal space."""
        return self.unwhiten(self.whitened_projection(self.whiten(xi))) if self.vertical_dim else xi

    def ehess2rhess(self, egrad: Tensor, ehvp: Tensor, xi: Tensor) -> Tensor:
        """Quotient Hessian at a horizontal ``xi``: ``P Hess f[xi]``, ``(n,)`` (arguments as in
        [`connection_hessian`][manifolds.MetricQuotient.connection_hessian])."""
        return self.proj_horizontal(self.connection_hessian(egrad, ehvp, xi))

    def whitened_hessian(self, egrad: Tensor, hvp: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
        """``zeta -> P_w W Hess f[W^-1 P_w zeta]``: the quotient Hessian as a symmetric map on ``(n,)``.

        Its eigenvalues on the range of `whitened_projection` are those of the quotient Hessian relative
        to ``G``; eigenvectors map back to horizontal tangent vectors with `unwhiten`.

        Args:
            egrad: Euclidean gradient at the point, ``(n,)``.
            hvp: Euclidean Hessian-vector product on flat vectors, ``(n,) -> (n,)``.

        The map also takes ``horizontal=True``, the caller's promise that ``zeta`` is already horizontal (to
        rounding), which spares its first projection (``P M P zeta = P M zeta`` then); eigen-solvers use it on their
        own, already projected, vectors.
        """
        connection = self.connection_operator(self._solve(egrad))

        def apply(zeta: Tensor, horizontal: bool = False) -> Tensor:
            xi = self.unwhiten(zeta if horizontal else self.whitened_projection(zeta))
            return self.whitened_projection(self.whiten(self._solve(hvp(xi) - connection(xi))))

        return apply

    # -- geodesics --------------------------------------------------------------------------------------------

    geodesic = ("geodesics of the metric: RK4 on the geodesic equation x'' = -Gamma_x(x', x') (no closed-form "
                "exponential map)")

    def geodesic_map(self, directions: Tensor, radius: float = 1.0) -> GeodesicMap:
        """``c (B, k) -> Exp_w(c @ directions)`` ``(B, n)``: the geodesic equation integrated by RK4.

        Args:
            directions: horizontal tangent vectors at the point, ``(k, n)``.
            radius: the largest ``|c_i|`` asked for (a grid's half-width): the step count is chosen there.

        Returns:
            A [`manifolds.GeodesicMap`][manifolds.GeodesicMap]; its ``steps``, ``error`` and ``detail`` say how the
                geodesics were computed. A horizontal initial velocity keeps the geodesic horizontal (the metric
                is invariant), so it projects to the quotient's geodesic.
        """
        from manifolds._geodesic_ode import GeodesicMap  # the integrator builds on Metric, defined here

        return GeodesicMap(self.metric, self.point, directions, radius)

    def expmap(self, xi: Tensor) -> Tensor:
        """``Exp_w(xi)``, ``(n,)``: the geodesic equation integrated by RK4 to the error estimate's default tolerance
        (see [`geodesic_map`][manifolds.MetricQuotient.geodesic_map])."""
        return self.geodesic_map(xi[None])(xi.new_ones(1, 1))[0]

    def second_order_geodesic(self, xi: Tensor, t: float = 1.0) -> Tensor:
        """``w + t xi - t^2/2 Gamma(xi, xi)``, ``(n,)``: agrees with the geodesic ``Exp(t xi)`` to ``O(t^3)``."""
        return self.point + t * xi - 0.5 * t * t * self.christoffel(xi)
