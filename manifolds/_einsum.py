"""Two-operand ``torch.einsum`` calls of a traced graph, written as the matrix products they are.

Attention is often written with ``einsum``: ``torch.einsum("bhid,bhjd->bhij", q, k)`` for the scores and
``torch.einsum("bhij,bhjd->bhid", a, v)`` for the weighted values, in any axis order. Such a call is a batched
matrix product up to axis orders. With ``k`` the one letter of both operands that the output drops (summed), ``m`` a
letter of the left operand alone (the rows: the one written right before ``k``, else the output's last), ``n`` one of
the right operand alone (the columns: right after ``k``, else the output's last) and the output's other letters the
batch, it equals ``A.permute(batch, m, k) @ B.permute(batch, k, n)``, permuted to
the output's order; an operand lacking a batch letter that follows one it has gets a size-1 axis there
(``unsqueeze``), which ``matmul`` broadcasts, as it broadcasts missing leading ones by itself: a key or value without
a heads axis read by every query head (multi-query attention, ``"bhid,bjd->bhij"``). `as_matrix_products` returns a
copy of a graph with every such call replaced by those permutes, a ``matmul`` and the output's permute, each with its
shape, so that the symmetry discovery (`manifolds._attention`) and the R-operator products
(`sharpness.products._rop_graph`) read the attention in one form whichever way it is written.

Of the two operand orders (``a @ b`` or the transpose of ``b^T a^T``), a matrix of two axes is the right factor of a
batch of rows (``x @ W``, a linear layer as the weight readers know it); else the left factor is the operand holding
every batch axis (the query or the attention weights; the key or value is what a product broadcasts), then the order
whose product already has the output's axis order. Rewritten: exactly two tensor operands as above, the equation written
explicitly (``->``) or implicitly (the output then holds the letters seen once, sorted, as torch reads it). Left as it
is (read as an unknown operation, which pins what it touches, with the reason): an ellipsis, a letter repeated in one
term (a diagonal), a letter of one operand alone that the output drops (a sum), a letter of different sizes in the two
operands (broadcast sizes), no letter or several summed, no letter of an operand alone kept, another number of operands,
axis lists instead of an equation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from manifolds._graph import target_name

# `meta` key of a rewritten call's matmul node: the einsum equation and the graph node it replaces (for messages)
EINSUM_META = "einsum"


@dataclass(frozen=True)
class _Plan:
    """How one einsum is a matmul: the operands (possibly swapped), their axis orders for the product, and the
    permutation of the product's axes into the output's."""

    first: fx.Node
    second: fx.Node
    first_order: tuple[int, ...]
    second_order: tuple[int, ...]
    out_order: tuple[int, ...]
    first_new: tuple[int, ...] = ()  # size-1 axes put in after the permute (a batch letter the operand lacks)
    second_new: tuple[int, ...] = ()


def _operands(node: fx.Node) -> tuple[object, list] | None:
    """``(equation, operands)`` of an ``einsum`` call node (operands passed one by one or as one list; the equation
    is not a string in the sublist form ``einsum(a, [0, 1], b, [1, 2])``), else ``None``."""
    if node.op != "call_function" or target_name(node) != "einsum" or node.kwargs or len(node.args) < 2:
        return None
    equation, rest = node.args[0], list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    return equation, rest


def _subscripts(equation: str, operands: int) -> tuple[list[str], str] | str:
    """The operands' letters and the output's, or why the equation is not read (a sentence's end)."""
    equation = equation.replace(" ", "")
    if "." in equation:
        return "it has an ellipsis"
    inputs, arrow, out = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != operands or not all(t.isalpha() for t in terms) or (arrow and not (out.isalpha() or out == "")):
        return "its equation does not name one axis per letter of each operand"
    if not arrow:  # implicit output: the letters seen exactly once, sorted (upper case first, as torch sorts them)
        letters = "".join(terms)
        out = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if any(len(set(t)) != len(t) for t in (*terms, out)):
        return "a letter is repeated in one term (a diagonal)"
    if not set(out) <= set("".join(terms)):
        return "its output has a letter no operand has"
    return terms, out


def _plan(node: fx.Node) -> _Plan | str:
    """The matmul form of an einsum ``node`` (see the module docstring), else why there is none (a sentence's end).
    Of the two operand orders, a matrix is the right factor of a batch of rows (``x @ W``); else the left factor holds
    every batch axis, and the order whose product already has the output's axis order is taken where there is one
    (``"bhjd,bhij->bhid"`` of values and weights is ``weights @ values``, the order attention is read in)."""
    parsed = _operands(node)
    if parsed is None:
        return "it is not an einsum call with positional operands"
    equation, operands = parsed
    if not isinstance(equation, str):
        return "its operands are given with axis lists instead of an equation"
    if len(operands) != 2 or not all(isinstance(t, fx.Node) for t in operands):
        return f"it has {len(operands)} operands, not two tensors"
    letters = _subscripts(equation, 2)
    if isinstance(letters, str):
        return letters
    a, b = operands
    (sa, sb), out = letters
    shape_a, shape_b = a.meta.get("shape"), b.meta.get("shape")
    if shape_a is None or shape_b is None or len(shape_a) != len(sa) or len(shape_b) != len(sb):
        return "its operands' shapes are unknown"
    if any(shape_a[sa.index(c)] != shape_b[sb.index(c)] for c in set(sa) & set(sb)):
        return "a letter has different sizes in the two operands (broadcasting)"
    if (set(sa) ^ set(sb)) - set(out):
        return "it sums an axis of one operand alone"
    sizes_a, sizes_b = dict(zip(sa, shape_a)), dict(zip(sb, shape_b))
    plans = [p for p in (_ordered(a, sa, b, sb, out, sizes_a, sizes_b), _ordered(b, sb, a, sa, out, sizes_b, sizes_a))
             if p is not None]  # fmt: skip
    if not plans:
        return ("it is not one matrix product per batch entry (one letter summed over both operands, one kept from "
                "each, the others shared by both and the output)")  # fmt: skip
    # a matrix read by a batch of rows is `x @ W` (a linear layer, as the readers of weights know it); else the left
    # factor is the operand holding every batch axis (attention's query or weights: the key or value is the one a
    # product broadcasts), then the order whose product has the output's axis order
    layer = [p for p in plans if len(p.second_order) == 2 and len(p.first_order) > 2]
    full = [p for p in plans if not p.first_new] or plans
    same = [p for p in full if p.out_order == tuple(range(len(out)))]
    return (layer or same or full)[0]


def _ordered(a: fx.Node, sa: str, b: fx.Node, sb: str, out: str, sizes_a: dict, sizes_b: dict) -> _Plan | None:
    """``a`` times ``b`` as a matmul (``a`` the left factor), else ``None``. The rows are the letter of ``a`` alone
    that ``a`` holds beside the summed letter (``(..., m, k)`` or ``(..., k, m)``: ``"bhij"`` or ``"bhji"`` of attention
    weights times values), of the summed letter's size where two are (the query tokens, not the heads), else the
    output's last of ``a`` alone; the columns likewise of ``b``; the other output letters are the batch, in the output's
    order. An operand lacking a batch letter after one it has gets a size-1 axis there (``matmul`` broadcasts it;
    leading ones it broadcasts by itself): a key without a heads axis read by every query head (multi-query
    attention)."""
    k = [c for c in sa if c in sb and c not in out]
    rows = [c for c in out if c in sa and c not in sb]
    columns = [c for c in out if c in sb and c not in sa]
    if len(k) != 1 or not rows or not columns:
        return None
    (summed,) = k

    def next_to_k(letters: str, candidates: list[str], sizes: dict[str, int]) -> str:
        # written beside the summed letter first (a matrix's two axes), then of its size (the query tokens against the
        # key tokens they are summed with, not the heads), then the output's last
        return max(candidates, key=lambda x: (abs(letters.index(x) - letters.index(summed)) == 1,
                                              sizes[x] == sizes[summed], out.index(x)))  # fmt: skip

    m, n = next_to_k(sa, rows, sizes_a), next_to_k(sb, columns, sizes_b)
    batch = [c for c in out if c not in (m, n)]

    def arranged(letters: str, matrix: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        present = [i for i, c in enumerate(batch) if c in letters]
        kept = batch[present[0] :] if present else []
        order = [c for c in kept if c in letters] + matrix
        if len(order) != len(letters):
            return None
        return tuple(letters.index(c) for c in order), tuple(i for i, c in enumerate(kept) if c not in letters)

    first, second = arranged(sa, [m, *k]), arranged(sb, [*k, n])
    if first is None or second is None:
        return None
    return _Plan(a, b, first[0], second[0], tuple([*batch, m, n].index(c) for c in out), first[1], second[1])


def _permuted(graph: fx.Graph, node: fx.Node, order: tuple[int, ...], new: tuple[int, ...] = ()) -> fx.Node:
    """``node`` with its axes in ``order`` (no node for the identity; ``transpose(-2, -1)`` for a swap of the last
    two, the spelling the product patterns and the weight readers know), then a size-1 axis at each of ``new`` (in
    increasing order), with its shape."""
    rank = len(order)
    out = node
    if order == (*range(rank - 2), rank - 1, rank - 2):
        out = graph.call_method("transpose", (node, -2, -1))
    elif order != tuple(range(rank)):
        out = graph.call_method("permute", (node, *order))
    if out is not node:
        out.meta["shape"] = tuple(node.meta["shape"][i] for i in order)
    for axis in new:
        wider = graph.call_method("unsqueeze", (out, axis))
        shape = out.meta["shape"]
        wider.meta["shape"] = (*shape[:axis], 1, *shape[axis:])
        out = wider
    return out


def rewritable(node: fx.Node) -> bool:
    """Whether ``node`` is an ``einsum`` call `as_matrix_products` writes as a matmul."""
    return isinstance(_plan(node), _Plan)


def is_einsum(node: fx.Node) -> bool:
    """Whether ``node`` calls ``torch.einsum``."""
    return node.op == "call_function" and target_name(node) == "einsum"


def not_rewritten(node: fx.Node) -> str:
    """Why the einsum ``node`` is not written as a matmul (a sentence's end), for the pins that name it."""
    plan = _plan(node)
    return "" if isinstance(plan, _Plan) else plan


def as_matrix_products(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` (its nodes' ``meta`` copied) with every rewritable einsum call replaced by permutes, one
    ``matmul`` and the output's permute, each new node's ``meta["einsum"]`` the equation and the replaced node's name
    (messages name the einsum the user wrote); ``graph`` itself is returned where no call is rewritten."""
    if not any(rewritable(n) for n in graph.nodes):
        return graph
    copy = fx.Graph()
    mapping: dict[fx.Node, fx.Node] = {}
    out = copy.graph_copy(graph, mapping)
    copy.output(out)
    for node in list(copy.nodes):
        plan = _plan(node)
        if not isinstance(plan, _Plan):
            continue
        before = set(copy.nodes)
        with copy.inserting_before(node):
            a = _permuted(copy, plan.first, plan.first_order, plan.first_new)
            b = _permuted(copy, plan.second, plan.second_order, plan.second_new)
            product = copy.call_function(torch.matmul, (a, b))
            shape_a, shape_b = a.meta["shape"], b.meta["shape"]
            product.meta["shape"] = (*torch.broadcast_shapes(shape_a[:-2], shape_b[:-2]), shape_a[-2], shape_b[-1])
            result = _permuted(copy, product, plan.out_order)
        for new in set(copy.nodes) - before:  # what the user wrote: one einsum
            new.meta[EINSUM_META] = (node.args[0], node.name)
        node.replace_all_uses_with(result)
        copy.erase_node(node)
    return copy


__all__ = ["EINSUM_META", "as_matrix_products", "is_einsum", "not_rewritten", "rewritable"]
