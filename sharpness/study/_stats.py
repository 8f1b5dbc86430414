"""Rank correlation of a measure with generalization: Kendall's tau-b, Jiang et al.'s granulated tau and
bootstrap confidence intervals.

Jiang et al., "Fantastic Generalization Measures and Where to Find Them" (ICLR 2020), Sec. 2.2 and 4: the
Kendall tau of a measure against the generalization gap over all models says how well the measure ranks them;
the granulated tau ``psi_i`` of hyperparameter column ``i`` averages the tau over the groups of models that
share the values of every OTHER hyperparameter column (so only column ``i`` varies inside a group), and
``psi`` is the mean of ``psi_i`` over the columns. A measure that predicts generalization only through one
hyperparameter (say width) shows a high tau but a low ``psi`` on the others.

Edge cases, all returning NaN rather than a number that means nothing:

- a pair is counted only where both values are present: rows with NaN in the measure or the gap are left out;
- tau of fewer than two rows, or of values that do not vary (every pair tied in either variable), is NaN,
  as `scipy.stats.kendalltau` says;
- a group of the granulated tau with fewer than two usable rows, or without variation in the measure or the
  gap, contributes nothing: ``psi_i`` is the mean over the groups whose tau is defined (NaN where none is);
  ``psi`` is the mean over the columns whose ``psi_i`` is defined (NaN where none is);
- NaN in a hyperparameter column is a value like any other (such rows form groups of their own);
- the bootstrap resamples rows with replacement; a resample in which a statistic is undefined is left out
  of its percentiles (all undefined: NaN interval). A resampled row and its copy form a pair tied in both
  variables, which tau-b counts in neither its numerator nor its denominator.

Everything is computed from the same pair sums, ``sum sign(dx) sign(dy)``, ``sum |sign(dx)|`` and
``sum |sign(dy)|`` over the pairs of rows, vectorized over bootstrap resamples.
"""

from __future__ import annotations

import numpy as np

# Bootstrap resamples are processed in chunks whose pair arrays hold at most this many entries (about 32 MB of
# float64 per array), so 1000 resamples of a few hundred rows fit in memory.
_CHUNK_ENTRIES = 4_000_000


def _as_vector(values, name: str) -> np.ndarray:
    """``values`` as a 1-D float64 array (NaN for missing), or ``ValueError`` naming ``name``."""
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must hold numbers (NaN for missing values)") from None
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def _signs(values: np.ndarray) -> np.ndarray:
    """``(..., n, n)`` array of ``sign(v[a] - v[b])`` for ``values`` ``(..., n)``; comparisons, not differences,
    so infinities are ordered (and tie with themselves) instead of producing NaN."""
    left, right = values[..., :, None], values[..., None, :]
    return (left > right).astype(np.float64) - (left < right).astype(np.float64)


def _pair_sums(x: np.ndarray, y: np.ndarray, index: np.ndarray, same: np.ndarray | None):
    """Pair sums of the rows ``index`` ``(B, n)`` of ``x`` and ``y``: ``(numerator, untied_x, untied_y)``,
    each ``(B, n)``: row ``a``'s sums over the rows paired with it (in its group, where ``same`` ``(n, n)``
    says which original rows share a group). Rows with NaN in ``x`` or ``y`` pair with nothing."""
    xs, ys = x[index], y[index]
    valid = ~(np.isnan(xs) | np.isnan(ys))
    pairs = valid[:, :, None] & valid[:, None, :]
    if same is not None:
        pairs &= same[index[:, :, None], index[:, None, :]]
    sx, sy = _signs(xs) * pairs, _signs(ys) * pairs
    return (sx * sy).sum(-1), np.abs(sx).sum(-1), np.abs(sy).sum(-1)


def _tau_from_sums(num, untied_x, untied_y) -> np.ndarray:
    """tau-b from summed pair counts; NaN where either variable has no untied pair."""
    denominator = untied_x * untied_y
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, num / np.sqrt(np.where(denominator > 0, denominator, 1.0)), np.nan)


def _chunks(n_resamples: int, n: int):
    step = max(1, _CHUNK_ENTRIES // max(1, n * n))
    for start in range(0, n_resamples, step):
        yield slice(start, min(start + step, n_resamples))


def _tau_rows(x: np.ndarray, y: np.ndarray, index: np.ndarray) -> np.ndarray:
    """tau-b of each resample (row of ``index`` ``(B, n)``): ``(B,)``."""
    out = np.empty(index.shape[0])
    for part in _chunks(index.shape[0], index.shape[1]):
        out[part] = _tau_from_sums(*(s.sum(-1) for s in _pair_sums(x, y, index[part], None)))
    return out


def _group_codes(columns: list[list], n: int) -> np.ndarray:
    """One integer per row (``n`` rows), equal for rows whose values agree in every one of ``columns`` (NaN
    equals NaN; no columns: one group)."""
    if not columns:
        return np.zeros(n, dtype=np.int64)
    keys = [tuple("nan" if isinstance(v, float) and v != v else v for v in row) for row in zip(*columns)]
    lookup: dict[tuple, int] = {}
    return np.array([lookup.setdefault(k, len(lookup)) for k in keys], dtype=np.int64)


def _psi_rows(x: np.ndarray, y: np.ndarray, index: np.ndarray, codes: list[np.ndarray]) -> np.ndarray:
    """Granulated tau of each resample and column: ``(B, len(codes))``, NaN where no group's tau is defined."""
    n_resamples, n = index.shape
    out = np.full((n_resamples, len(codes)), np.nan)
    for c, code in enumerate(codes):
        n_groups = int(code.max()) + 1 if code.size else 0
        same = code[:, None] == code[None, :]
        for part in _chunks(n_resamples, n):
            rows = index[part]
            b = rows.shape[0]
            # Scatter each row's pair sums onto its (resample, group) cell; every pair lies inside one group.
            cell = (np.arange(b)[:, None] * n_groups + code[rows]).ravel()
            sums = [np.bincount(cell, s.ravel(), b * n_groups).reshape(b, n_groups)
                    for s in _pair_sums(x, y, rows, same)]  # fmt: skip
            taus = _tau_from_sums(*sums)
            defined = ~np.isnan(taus)
            counts = defined.sum(-1)
            with np.errstate(invalid="ignore"):
                out[part, c] = np.where(counts > 0, np.where(defined, taus, 0.0).sum(-1) / counts, np.nan)
    return out


def _nanmean_rows(values: np.ndarray) -> np.ndarray:
    """Mean of each row over its non-NaN entries; NaN for a row without any (no warning)."""
    defined = ~np.isnan(values)
    counts = defined.sum(-1)
    with np.errstate(invalid="ignore"):
        return np.where(counts > 0, np.where(defined, values, 0.0).sum(-1) / np.maximum(counts, 1), np.nan)


def kendall_tau(x, y) -> float:
    """Kendall's tau-b of ``x`` against ``y``, rows with NaN in either left out.

    Args:
        x: ``(n,)`` numbers (a measure over ``n`` models); NaN for missing values.
        y: ``(n,)`` numbers (the generalization gap).

    Returns:
        tau-b in ``[-1, 1]`` (``(concordant - discordant) / sqrt(untied pairs in x * untied pairs in y)``, as
        `scipy.stats.kendalltau`), or NaN with fewer than two usable rows or no variation in either.

    Raises:
        ValueError: ``x`` or ``y`` not one-dimensional numbers, or of different lengths.
    """
    x, y = _as_vector(x, "x"), _as_vector(y, "y")
    if x.shape != y.shape:
        raise ValueError(f"x has {x.shape[0]} values but y has {y.shape[0]}; give one value per model in each")
    return float(_tau_rows(x, y, np.arange(x.shape[0])[None, :])[0])


def _table_arrays(table, measure: str, hyper_columns: list[str], gap: str):
    """The measure and gap as float arrays and one group code array per hyperparameter column."""
    missing = [c for c in [measure, gap, *hyper_columns] if c not in table.columns]
    if missing:
        names, have = ", ".join(map(repr, missing)), ", ".join(map(str, table.columns))
        raise ValueError(f"the table has no column {names}; its columns are {have}")
    if len(set(hyper_columns)) != len(hyper_columns):
        raise ValueError(f"hyperparameter columns repeat: {hyper_columns}; name each once")
    x = _as_vector(table[measure].to_numpy(), f"column {measure!r}")
    y = _as_vector(table[gap].to_numpy(), f"column {gap!r}")
    values = {c: list(table[c].to_numpy()) for c in hyper_columns}
    codes = [_group_codes([values[o] for o in hyper_columns if o != c], len(x)) for c in hyper_columns]
    return x, y, codes


def granulated_tau(table, measure: str, hyper_columns: list[str], gap: str = "gap") -> dict:
    """Jiang et al.'s granulated Kendall tau of ``measure`` against ``gap``.

    Args:
        table: a pandas DataFrame, one row per model.
        measure: the column of the measure.
        hyper_columns: the hyperparameter columns.
        gap: the column of the generalization gap.

    Returns:
        ``{"per_column": {column: psi_column}, "average": psi}``: ``psi_column`` is the mean, over the groups of
        rows sharing every other hyperparameter column's value, of the tau within the group; ``psi`` the mean
        of the defined ``psi_column`` (the module docstring lists the cases that give NaN).

    Raises:
        ValueError: a column missing from the table, repeated, or holding non-numbers in the measure or gap.
    """
    x, y, codes = _table_arrays(table, measure, hyper_columns, gap)
    per_column = _psi_rows(x, y, np.arange(x.shape[0])[None, :], codes)[0]
    return {"per_column": {c: float(v) for c, v in zip(hyper_columns, per_column)},
            "average": float(_nanmean_rows(per_column[None, :])[0])}  # fmt: skip


def summarize(table, measures: list[str], hyper_columns: list[str], gap: str = "gap", n_boot: int = 1000,
              seed: int = 0, confidence: float = 0.95):  # fmt: skip
    """Tau, granulated tau and their bootstrap percentile intervals for each measure.

    Args:
        table: a pandas DataFrame, one row per model.
        measures: the measure columns, one output row each.
        hyper_columns: the hyperparameter columns of the granulated tau.
        gap: the column of the generalization gap.
        n_boot: bootstrap resamples (rows drawn with replacement; the same resamples for every measure).
        seed: seed of the resampling (the intervals are reproducible).
        confidence: the intervals' coverage, e.g. 0.95 for the 2.5th and 97.5th percentiles.

    Returns:
        DataFrame with columns ``measure, tau, tau_low, tau_high, psi, psi_low, psi_high`` and ``tau_<col>``
        (the granulated tau ``psi_col`` of each hyperparameter column); its ``attrs`` record ``n_boot``,
        ``seed``, ``confidence`` and ``gap``.

    Raises:
        ValueError: a column missing, ``n_boot < 1`` or ``confidence`` outside ``(0, 1)``.
    """
    import pandas as pd

    if not isinstance(n_boot, (int, np.integer)) or n_boot < 1:
        raise ValueError(f"n_boot must be a positive integer, got {n_boot!r}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence!r}")
    n = len(table)
    resamples = np.random.default_rng(seed).integers(0, n, size=(n_boot, n)) if n else np.zeros((n_boot, 0), int)
    identity = np.arange(n)[None, :]
    tail = 50.0 * (1.0 - confidence)
    rows = []
    for measure in measures:
        x, y, codes = _table_arrays(table, measure, hyper_columns, gap)
        per_column = _psi_rows(x, y, identity, codes)[0]
        boot_tau = _tau_rows(x, y, resamples)
        boot_psi = _nanmean_rows(_psi_rows(x, y, resamples, codes))
        row = {"measure": measure, "tau": float(_tau_rows(x, y, identity)[0])}
        row["tau_low"], row["tau_high"] = _percentiles(boot_tau, tail)
        row["psi"] = float(_nanmean_rows(per_column[None, :])[0])
        row["psi_low"], row["psi_high"] = _percentiles(boot_psi, tail)
        row.update({f"tau_{c}": float(v) for c, v in zip(hyper_columns, per_column)})
        rows.append(row)
    columns = ["measure", "tau", "tau_low", "tau_high", "psi", "psi_low", "psi_high"]
    frame = pd.DataFrame(rows, columns=columns + [f"tau_{c}" for c in hyper_columns])
    frame.attrs.update(n_boot=int(n_boot), seed=seed, confidence=float(confidence), gap=gap)
    return frame


def _percentiles(samples: np.ndarray, tail: float) -> tuple[float, float]:
    """The ``tail`` and ``100 - tail`` percentiles of the defined ``samples``; NaN, NaN where none is."""
    defined = samples[~np.isnan(samples)]
    if defined.size == 0:
        return float("nan"), float("nan")
    low, high = np.percentile(defined, [tail, 100.0 - tail])
    return float(low), float(high)
