"""Pure tensor-train (TT) helpers for AdaZeta's TT adapter: shapes, parameter counts, init, contraction.

A weight matrix W of size (in, out) is stored as a TT tensor of modes ``shape = [k_1..k_n]`` with
``prod(shape) == in * out``; ``W = reshape(full tensor, (in, out))`` in row-major order, so the first ``split``
modes index the rows (``prod(shape[:split]) == in``) and the remaining ones the columns. Core ``G_i`` has shape
``[r_{i-1}, k_i, r_i]`` with ``r_0 = r_n = 1``. Nothing here builds the dense (in, out) matrix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def factorize(n: int, num_factors: int = 3) -> list[int]:
    """Balanced factorization ``n = f_1 * ... * f_m`` (ascending) minimizing ``f_m / f_1``, then ``f_m``.

    E.g. 576 -> [8, 8, 9], 1024 -> [8, 8, 16], 4096 -> [16, 16, 16]; a prime p gives [1, ..., 1, p].
    """
    if n < 1 or num_factors < 1:
        raise ValueError(f"factorize needs n >= 1 and num_factors >= 1, got n={n}, num_factors={num_factors}")
    best: list[int] | None = None

    def key(factors: list[int]) -> tuple[float, int]:
        return (factors[-1] / factors[0], factors[-1])

    def search(rest: int, slots: int, low: int, prefix: list[int]) -> None:
        nonlocal best
        if slots == 1:
            if rest >= low:
                candidate = prefix + [rest]
                if best is None or key(candidate) < key(best):
                    best = candidate
            return
        # Ascending factors: the next one is at least `low` and at most the balanced share rest^(1/slots).
        f = low
        while f**slots <= rest:
            if rest % f == 0:
                search(rest // f, slots - 1, f, prefix + [f])
            f += 1

    search(n, num_factors, 1, [])
    assert best is not None  # [1, ..., 1, n] is always a candidate
    return best


def default_shape(in_features: int, out_features: int, num_factors: int = 3) -> list[int]:
    """TT modes of an (in, out) matrix: the balanced factors of ``in`` followed by those of ``out``."""
    return factorize(in_features, num_factors) + factorize(out_features, num_factors)


def split_index(shape: Sequence[int], in_features: int) -> int:
    """The first ``m`` in ``1..n-1`` with ``prod(shape[:m]) == in_features`` (row modes | column modes)."""
    prefix = 1
    for m, k in enumerate(shape[:-1], start=1):
        prefix *= k
        if prefix == in_features:
            return m
    raise ValueError(
        f"TT shape {list(shape)} cannot be split into input and output modes: no prefix of it multiplies to "
        f"in_features={in_features} (prefix products: {_prefix_products(shape)})"
    )


def _prefix_products(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[:m]) for m in range(1, len(shape))]


def tt_ranks(num_cores: int, rank: int) -> list[int]:
    """TT ranks ``[r_0, ..., r_n] = [1, r, ..., r, 1]``."""
    if num_cores < 1:
        raise ValueError(f"a tensor train needs at least one core, got num_cores={num_cores}")
    return [1] + [rank] * (num_cores - 1) + [1]


def tt_num_params(shape: Sequence[int], rank: int) -> int:
    """Number of core entries, ``sum_i r_{i-1} * k_i * r_i``."""
    ranks = tt_ranks(len(shape), rank)
    return sum(ranks[i] * k * ranks[i + 1] for i, k in enumerate(shape))


def init_cores(
    shape: Sequence[int],
    rank: int,
    in_features: int,
    out_features: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> list[Tensor]:
    """The reference code's init: ``G_i = randn(r_{i-1}, k_i, r_i) / sqrt(r_i) * s^(1/n)``, ``s = sqrt(1/(in+out))``.

    Each entry of the reconstructed matrix then has variance ``s^2`` (the 1/r_i factors cancel the number of
    rank paths). On the meta device the cores are left uninitialized: there is nothing to draw.
    """
    n = len(shape)
    ranks = tt_ranks(n, rank)
    scale = math.sqrt(1.0 / (in_features + out_features)) ** (1.0 / n)
    # `torch.empty(0)` resolves the ambient `with torch.device(...)` context when no device is given.
    target = torch.device(device) if device is not None else torch.empty(0).device
    cores = []
    for i, k in enumerate(shape):
        size = (ranks[i], k, ranks[i + 1])
        if target.type == "meta":
            cores.append(torch.empty(size, dtype=dtype, device=target))
            continue
        # Draw where the generator lives (a CPU generator cannot feed a CUDA randn), then move.
        draw_device = generator.device if generator is not None else target
        core = torch.randn(size, generator=generator, dtype=dtype, device=draw_device)
        cores.append((core / math.sqrt(ranks[i + 1]) * scale).to(target))
    return cores


def contract_cores(cores: Sequence[Tensor]) -> Tensor:
    """Contract a chain of cores into a matrix of shape ``(r_first * prod k_i, r_last)``, modes row-major.

    Cores may carry the same leading batch dimensions (``(..., r, k, r')``, e.g. one set of cores per weight
    replica); the result then has them too.
    """
    lead = cores[0].shape[:-3]
    result = cores[0].reshape(*lead, -1, cores[0].shape[-1])
    for core in cores[1:]:
        r_prev, k, r_next = core.shape[-3:]
        result = (result @ core.reshape(*lead, r_prev, k * r_next)).reshape(*lead, -1, r_next)
    return result


def tt_factors(cores: Sequence[Tensor], split: int) -> tuple[Tensor, Tensor]:
    """``(A, B)`` with ``W = A @ B``: A (in, r) the contraction of cores[:split], B (r, out) of cores[split:].

    Batched cores ``(G, r, k, r')`` give G pairs at once, ``(G, in, r)`` and ``(G, r, out)``.
    """
    a = contract_cores(cores[:split])  # (in, r), since r_0 = 1
    r = cores[split].shape[-3]
    b = contract_cores(cores[split:]).reshape(*cores[split].shape[:-3], r, -1)  # (r, out), since r_n = 1
    return a, b


def tt_matmul(x: Tensor, cores: Sequence[Tensor], split: int) -> Tensor:
    """``x @ W`` with ``W = A @ B`` (``tt_factors``).

    The dense (in, out) matrix is never formed: this is the rank-r "fast forward" of TT layers. Batched cores
    ``(R, r, k, r')`` with ``x`` of shape ``(R, ..., in)`` give replica r's product for ``x[r]``.
    """
    a, b = tt_factors(cores, split)
    if a.dim() > 2:  # one (A, B) per replica: x (R, ..., in) -> (R, M, in) for batched products
        flat = x.reshape(a.shape[0], -1, x.shape[-1])
        return ((flat @ a) @ b).reshape(*x.shape[:-1], b.shape[-1])
    return (x @ a) @ b
