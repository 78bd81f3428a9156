"""Every random choice of a run is a pure function of (the run's seed, the generation, what
it is for), so that every process draws the same, whatever it drew before, and a resumed run
draws what an uninterrupted one would."""

from __future__ import annotations

import numpy as np

__all__ = ["EVALUATION_STREAM", "INIT_STREAM", "NOISE_STREAM", "PARENT_STREAM",
           "generation_rng"]

#: What a generation's generator is for: the noise seeds (ES pairs, GA mutations), the GA's
#: choice of parents, the seed members are evaluated with, the GA's initialisation seeds.
NOISE_STREAM, PARENT_STREAM, EVALUATION_STREAM, INIT_STREAM = 0, 1, 2, 3


def generation_rng(seed: int, generation: int, stream: int) -> np.random.Generator:
    """The generator of one kind of random choice (``stream``) of one generation."""
    return np.random.default_rng([seed, generation, stream])
