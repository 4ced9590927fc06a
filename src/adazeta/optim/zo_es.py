"""ES: the evolution-strategies estimator of ES fine-tuning (Salimans et al. 2017; Qiu et al. 2025, "Evolution
Strategies at Scale: LLM Fine-Tuning Beyond RL"), on the engine's directions.

A step's population is the 2Q antithetic members w + sigma z_q and w - sigma z_q (sigma is ``eps``), each
evaluated once. Their fitness is the negative loss, z-scored over the population (s_n = (L_n - mean L) / std L,
population std; all equal: no move), and the update is ES's

    w <- w - lr (1 / 2Q) sum_q (s_q+ - s_q-) z_q

which is ZO-SGD's update with g_q = (s_q+ - s_q-) / 2 (reduction mean). The z-scoring makes the step's size
independent of the loss's scale and of sigma: lr is ES's alpha. Batched queries and query- or data-parallel runs
apply as for central differences (the shaping needs all 2Q losses: after the ranks' sum).

At Q = 1 this is ZO-SignSGD as ZO-Bench's code runs it: two members z-score to +1 and -1 (or both to 0), so the
step is lr sign(L(w + sigma z) - L(w - sigma z)) z, whatever the size of the difference.

The ES fine-tuning authors' code (VsonicV/es-fine-tuning-paper ``es_fine-tuning_conciseness.py`` 219-309) draws
N independent members (POPULATION_SIZE = 30, SIGMA = 1e-3, ALPHA = 5e-4), evaluates each once at w + sigma z_n,
normalises the rewards R_n = -L_n by ``(R - R.mean()) / (R.std() + 1e-8)`` (population std) and steps

    w <- w - lr (1/N) sum_n (L_n - mean L) / (std L + 1e-8) z_n

Estimator ``es_independent`` runs that rule, N = Q members and Q forwards a step (``schedule.q=30`` for the
authors' population); one process, sequential forwards.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from adazeta.optim import OPTIMIZERS
from adazeta.optim.differences import FiniteDifferences
from adazeta.optim.engine import register_estimator
from adazeta.optim.spsa import decay_groups
from adazeta.optim.zo_sgd import ZOSGD, ZOSGDConfig


def fitness_shaped(losses: torch.Tensor) -> torch.Tensor:
    """g_q = (s_q+ - s_q-) / 2 from the central losses [L1+, L1-, L2+, L2-, ...], s the z-scored losses."""
    spread = losses.std(unbiased=False)
    if not bool(spread > 0):
        return torch.zeros(losses.numel() // 2, dtype=losses.dtype, device=losses.device)
    shaped = (losses - losses.mean()) / spread
    return (shaped[0::2] - shaped[1::2]) / 2


register_estimator(FiniteDifferences("es", "central", shape=fitness_shaped))


def fitness_normalised(losses: torch.Tensor) -> torch.Tensor:
    """g_n = (L_n - mean L) / (std L + 1e-8) over the N members' losses (the authors' reward normalisation)."""
    return (losses - losses.mean()) / (losses.std(unbiased=False) + 1e-8)


register_estimator(FiniteDifferences("es_independent", "members", shape=fitness_normalised, batched=False,
                                     parallel=()))


@dataclasses.dataclass
class ESConfig(ZOSGDConfig):
    """ES: antithetic population of 2Q members, z-scored fitness, SGD step of size lr."""

    lr: float = 5e-4  # ES's alpha (Qiu et al. 2025: 5e-4 with sigma 1e-3 on full models)
    estimator: str = "es"


@OPTIMIZERS.register("es", ESConfig)
def build_es(named_params: Iterable[tuple[str, torch.Tensor]], cfg: ESConfig, seed: int) -> ZOSGD:
    return ZOSGD(decay_groups(named_params, cfg.weight_decay), cfg, seed=seed)
