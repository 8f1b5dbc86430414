"""geoopt manifolds for Riemannian optimisation on the rescaling quotient of ReLU networks.

Each manifold describes ONE parameter tensor; wrap a tensor in a ``geoopt.ManifoldParameter`` with
it (or let `quotient_parameters` do so for a whole model) and any geoopt optimiser
(``geoopt.optim.RiemannianSGD``, ``geoopt.optim.RiemannianAdam``) follows the metric:

- `LayerScaleEuclidean`: ``g_W(u, v) = <u, v> / ||W||^2`` (whole-tensor Frobenius norm), the
  per-block metric of the scale-invariant flatness paper. A layer-wise rescaling multiplies every
  tensor by one positive scalar; gradient steps, momentum and the Adam statistics transform with it,
  so training a rescaled copy reproduces the original losses exactly. It does NOT follow node-wise
  rescalings (a tensor's entries then scale by different factors).
- `LogEuclidean`: ``g_w(u, v) = sum_k u_k v_k / w_k^2``, Euclidean in ``log|w_k|``. Every
  positive rescaling (node-, channel- or layer-wise) is a translation there, so training follows all
  of them exactly. Entries never change sign, and an entry that is exactly zero stays zero.

Both manifolds treat the whole tensor as one point: there are no batch dimensions (``ndim = 0``
only tells geoopt's shape check that any shape, scalars included, is accepted) and ``inner`` sums
over every entry.

geoopt 0.5.1's ``RiemannianSGD`` seeds its momentum buffer with the Euclidean gradient and then
adds the Riemannian one; the two scale oppositely under rescaling, so the very first momentum
step breaks the equivariance. [`zero_init_momentum`][manifolds._geoopt.zero_init_momentum] seeds zeros instead.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import geoopt
import torch
from geoopt.manifolds.base import Manifold
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from manifolds._quotient import QUOTIENTS


def _sum_all(t: Tensor, keepdim: bool) -> Tensor:
    """Sum over every dimension; ``keepdim`` keeps them as size-1 dims (broadcastable to ``t``)."""
    if t.dim() == 0:
        return t
    return t.sum(dim=tuple(range(t.dim())), keepdim=keepdim)


def _ratio(u: Tensor, x: Tensor) -> Tensor:
    """``u / x`` elementwise, defined as 0 where ``x == 0`` (NaN-free also in backward)."""
    zero = x == 0
    return torch.where(zero, torch.zeros_like(u), u / torch.where(zero, torch.ones_like(x), x))


class LayerScaleEuclidean(Manifold):
    """Nonzero tensors with the scale-invariant metric ``g_W(u, v) = <u, v> / ||W||^2``.

    ``W`` is any nonzero tensor (shape ``S``); tangent vectors have the same shape ``S`` and the
    norm is the Frobenius norm of the whole tensor. Under ``W -> c W`` (``c > 0``) the Euclidean
    gradient scales by ``1/c`` and every operation below is equivariant: the Riemannian gradient,
    retraction steps and transported momentum all scale by ``c``.

    - ``egrad2rgrad(W, g) = ||W||^2 g`` (the metric dual of ``g``);
    - ``retr(W, u) = W + u``, a first-order retraction;
    - ``expmap``: the exact geodesic. ``W = r theta`` with ``s = log r`` makes the metric
      ``ds^2 + |d theta|^2``, the product of a line and the unit sphere, so with
      ``alpha = <W, u> / ||W||^2``, ``u_perp = u - alpha W`` and ``phi = ||u_perp|| / ||W||``:
      ``Exp_W(u) = e^alpha (cos(phi) W + sin(phi) / phi * u_perp)``;
    - ``transp(W, Y, v) = v ||Y|| / ||W||``, an isometry ``T_W -> T_Y`` for any nonzero ``Y``;
    - ``proju`` and ``projx`` are the identity (the manifold is open in ``R^S``).

    The zero tensor is not a point (the metric blows up); `check_point` refuses it with a
    reason, so ``geoopt.ManifoldParameter(torch.zeros(3), manifold=LayerScaleEuclidean())`` raises.
    The operations themselves do not check (they run in the optimiser's inner loop).

    Example:
        >>> import torch
        >>> LayerScaleEuclidean().egrad2rgrad(torch.tensor([3.0, 4.0]), torch.tensor([1.0, 0.0]))
        tensor([25.,  0.])
    """

    name = "LayerScaleEuclidean"
    ndim = 0
    # retr(retr(x, u), -transp(u)) != x: W + u - u ||W + u|| / ||W||
    reversible = False

    @staticmethod
    def _nonzero(x: Tensor) -> tuple[bool, str | None]:
        if x.numel() == 0 or not bool(x.ne(0).any()):
            return False, (
                f"a tensor of shape {tuple(x.shape)} that is all zeros is not a point of the layer-scale "
                "manifold: its metric <u, v> / ||x||^2 is undefined there"
            )
        return True, None

    def check_point(self, x: Tensor, *, explain: bool = False) -> tuple[bool, str | None] | bool:
        """Whether ``x`` can be used as a point: any shape, not all zeros (``explain``: with a reason)."""
        ok, reason = self._check_shape(x.shape, "x")
        if ok:
            ok, reason = self._nonzero(x)
        return (ok, reason) if explain else ok

    def assert_check_point(self, x: Tensor) -> None:
        """Raise ``ValueError`` with the reason when `check_point` fails."""
        ok, reason = self.check_point(x, explain=True)
        if not ok:
            raise ValueError(f"`x` is not a valid point of the {self.name} manifold: {reason}")

    def _check_point_on_manifold(self, x: Tensor, *, atol: float = 1e-5, rtol: float = 1e-5) -> tuple[bool, str | None]:
        ok, reason = self._nonzero(x)
        if ok and not bool(torch.isfinite(x).all()):
            ok, reason = False, "x has non-finite entries"
        return ok, reason

    def _check_vector_on_tangent(
        self, x: Tensor, u: Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        # the manifold is open in R^S: every vector of the point's shape is tangent
        if u.shape != x.shape:
            return False, f"u has shape {tuple(u.shape)} but the point has shape {tuple(x.shape)}"
        return True, None

    def inner(self, x: Tensor, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """``<u, v> / ||x||^2`` (``v = u`` if ``None``): a scalar, or size-1 dims with ``keepdim``."""
        uv = u * u if v is None else u * v
        return _sum_all(uv, keepdim) / _sum_all(x * x, keepdim)

    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        return _sum_all(x * x, keepdim=True) * u

    def proju(self, x: Tensor, u: Tensor) -> Tensor:
        return u

    def projx(self, x: Tensor) -> Tensor:
        return x

    def retr(self, x: Tensor, u: Tensor) -> Tensor:
        return x + u

    def expmap(self, x: Tensor, u: Tensor) -> Tensor:
        sq = _sum_all(x * x, keepdim=True)
        alpha = _sum_all(x * u, keepdim=True) / sq
        u_perp = u - alpha * x
        phi = (_sum_all(u_perp * u_perp, keepdim=True) / sq).sqrt()
        # sin(phi) / phi = sinc(phi / pi), smooth through phi = 0 (u parallel to x)
        return alpha.exp() * (phi.cos() * x + torch.sinc(phi / torch.pi) * u_perp)

    def transp(self, x: Tensor, y: Tensor, v: Tensor) -> Tensor:
        return v * (_sum_all(y * y, keepdim=True) / _sum_all(x * x, keepdim=True)).sqrt()


class LogEuclidean(Manifold):
    """Tensors with the elementwise metric ``g_w(u, v) = sum_k u_k v_k / w_k^2`` (log-Euclidean).

    In coordinates ``z_k = log|w_k|`` the metric is Euclidean and every positive rescaling
    ``w -> c * w`` (``c > 0`` elementwise, shape ``S`` like ``w``) is a translation, so the
    operations below are equivariant under all of them: the Riemannian gradient, steps and
    transported momentum scale by ``c``.

    - ``egrad2rgrad(w, g) = w^2 g``;
    - ``retr(w, u) = expmap(w, u) = w exp(u / w)``, the exact geodesic (a straight line in ``z``);
      signs never change;
    - ``transp(w, y, v) = v y / w``, the parallel transport (a translation in ``z``);
    - ``inner(w, u, v) = sum_k u_k v_k / w_k^2``; ``component_inner`` keeps the entries apart, so
      ``RiemannianAdam`` normalises each entry by its own second moment.

    Zero entries: ``w_k = 0`` is infinitely far away in this metric, so such an entry is a fixed
    point. Everywhere ``u_k / w_k := 0`` where ``w_k = 0``: the entry stays exactly zero, tangent
    vectors have no component there (``proju`` zeroes it), and ``inner`` sums over nonzero entries
    only. Any tensor is therefore a valid point. ``retr`` overflows to ``inf`` when a step asks an
    entry to grow by more than ``exp(700)`` (float64); that is a step size problem.

    Example:
        >>> import torch
        >>> LogEuclidean().retr(torch.tensor([2.0, -1.0, 0.0]), torch.tensor([2.0, 1.0, 5.0]))
        tensor([ 5.4366, -0.3679,  0.0000])
    """

    name = "LogEuclidean"
    ndim = 0
    # retr(retr(w, u), -transp(u)) = w exp(u / w) exp(-u / w) = w
    reversible = True

    def _check_point_on_manifold(self, x: Tensor, *, atol: float = 1e-5, rtol: float = 1e-5) -> tuple[bool, str | None]:
        if not bool(torch.isfinite(x).all()):
            return False, "x has non-finite entries"
        return True, None

    def _check_vector_on_tangent(
        self, x: Tensor, u: Tensor, *, atol: float = 1e-5, rtol: float = 1e-5
    ) -> tuple[bool, str | None]:
        if u.shape != x.shape:
            return False, f"u has shape {tuple(u.shape)} but the point has shape {tuple(x.shape)}"
        off = u[x == 0].abs()
        if off.numel() and bool((off > atol).any()):
            return False, (
                f"u is nonzero (up to {off.max().item():.3g}) where x is exactly zero; zero entries are "
                "fixed points, tangent vectors vanish there"
            )
        return True, None

    def component_inner(self, x: Tensor, u: Tensor, v: Tensor | None = None) -> Tensor:
        """Entrywise ``u_k v_k / x_k^2`` (0 where ``x_k = 0``), shape ``S``."""
        return _ratio(u, x) * _ratio(u if v is None else v, x)

    def inner(self, x: Tensor, u: Tensor, v: Tensor | None = None, *, keepdim: bool = False) -> Tensor:
        """``sum_k u_k v_k / x_k^2`` over nonzero ``x_k``: a scalar, or size-1 dims with ``keepdim``."""
        return _sum_all(self.component_inner(x, u, v), keepdim)

    def egrad2rgrad(self, x: Tensor, u: Tensor) -> Tensor:
        return x * x * u

    def proju(self, x: Tensor, u: Tensor) -> Tensor:
        return torch.where(x == 0, torch.zeros_like(u), u)

    def projx(self, x: Tensor) -> Tensor:
        return x

    def retr(self, x: Tensor, u: Tensor) -> Tensor:
        return x * _ratio(u, x).exp()

    def expmap(self, x: Tensor, u: Tensor) -> Tensor:
        return self.retr(x, u)

    def transp(self, x: Tensor, y: Tensor, v: Tensor) -> Tensor:
        return v * _ratio(y, x)


def quotient_parameters(model: nn.Module, metric: str = "layer", *, exclude: Iterable[str] = ()) -> nn.Module:
    """A deep copy of ``model`` whose trainable parameters are ``geoopt.ManifoldParameter``s.

    ``model`` itself is left untouched. Train the copy with a geoopt optimiser to follow the quotient
    metric, e.g. ``geoopt.optim.RiemannianSGD(copy.parameters(), lr=1e-2)``; with ``momentum > 0``
    also call `zero_init_momentum` on the optimiser to keep the first step equivariant.
    Parameters with ``requires_grad=False`` stay as they are; tied parameters stay tied.

    Args:
        model: any module; parameters of shape ``S`` become manifold parameters of shape ``S``.
        metric: ``"layer"``: `LayerScaleEuclidean` per tensor (follows layer-wise rescalings;
            every tensor must be nonzero). ``"node"``: `LogEuclidean` per tensor (follows
            node-, channel- and layer-wise rescalings; entries keep their sign and zero entries stay
            zero for ever).
        exclude: names (as in ``model.named_parameters()``) of parameters kept as plain Euclidean
            ``nn.Parameter``s, which geoopt optimisers update like ``torch.optim`` does. Use it for
            zero-initialised biases or for tensors outside the rescaling symmetry (e.g. norm layers).

    Returns:
        The modified copy.

    Raises:
        ValueError: unknown ``metric``; a name in ``exclude`` that ``model`` does not have; with
            ``metric="layer"``, a trainable tensor that is all zeros (the message names it).
    """
    if metric not in QUOTIENTS:
        raise ValueError(f"unknown metric {metric!r}; use one of {', '.join(QUOTIENTS)}")
    manifold = QUOTIENTS[metric].geoopt_manifold()
    out = copy.deepcopy(model)
    aliases: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for name, p in out.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), (p, []))[1].append(name)
    excluded = set(exclude)
    unknown = excluded - {n for _, names in aliases.values() for n in names}
    if unknown:
        raise ValueError(
            f"exclude names {', '.join(sorted(unknown))}, which are not parameters of the model; "
            "use names from model.named_parameters()"
        )
    for p, names in aliases.values():
        if not p.requires_grad or excluded.intersection(names):
            continue
        ok, reason = manifold.check_point(p.detach(), explain=True)
        if not ok:
            raise ValueError(
                f"parameter {names[0]!r} cannot use metric={metric!r} ({reason}); zero-initialised biases "
                f"are the usual cause: use metric='node' or pass exclude=[{names[0]!r}] to keep it Euclidean"
            )
        new = geoopt.ManifoldParameter(p.detach(), manifold=manifold)
        for name in names:
            owner, _, leaf = name.rpartition(".")
            setattr(out.get_submodule(owner), leaf, new)
    return out


def zero_init_momentum(optimizer: torch.optim.Optimizer) -> RemovableHandle:
    """Make ``geoopt.optim.RiemannianSGD``'s momentum start from zero, so momentum is equivariant.

    geoopt (0.5.1 and its master branch) seeds a new momentum buffer with a copy of the Euclidean
    gradient ``g`` and then updates it to ``momentum * g + rgrad``. ``g`` scales like ``1/c`` and the
    Riemannian gradient like ``c`` under a rescaling by ``c``, so that first buffer, and with it the
    whole trajectory, is not equivariant. This registers a step pre-hook that seeds a zero buffer
    for every parameter that is about to get its first momentum update; the first buffer is then
    ``(1 - dampening) * rgrad``, as in ``torch.optim.SGD`` (which it also leaves unchanged when
    ``dampening = 0``).

    Args:
        optimizer: an optimiser whose parameter groups use a ``"momentum"`` entry and the
            ``"momentum_buffer"`` state key (``RiemannianSGD``, ``torch.optim.SGD``).

    Returns:
        The hook's handle; ``handle.remove()`` restores geoopt's behaviour.
    """

    def seed(opt: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for group in opt.param_groups:
            if group.get("momentum", 0) <= 0:
                continue
            for p in group["params"]:
                if p.grad is not None and "momentum_buffer" not in opt.state[p]:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p)

    return optimizer.register_step_pre_hook(seed)
