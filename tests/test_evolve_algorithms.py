"""The algorithms of gradient-free training, as pure functions: the ES update rebuilt from
seeds and ranks equals the update computed directly from the materialised perturbations
(and torch's optimizers), a GA individual rebuilt from its seeds equals the one it
encodes, with or without its parent cached, and what a generation exchanges decodes to
what was encoded, in the bytes the docs promise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dasktrain as dt
from dasktrain.evolve.deep_ga import GeneticAlgorithm
from dasktrain.evolve.model import initial_parameters
from dasktrain.evolve.noise import noise_source
from dasktrain.evolve.openai_es import EvolutionStrategy
from dasktrain.evolve.shaping import (
    centered_ranks,
    decode_ranks,
    encode_ranks,
    ranks_of,
    ranks_size,
)
from dasktrain.evolve.wire import (
    decode_record,
    decode_result,
    encode_record,
    encode_result,
    worker_id,
)
from tests.common.evolution import tiny_net

SIZE, POPULATION, SIGMA = 37, 8, 0.1

OPTIMIZERS = {
    "sgd-nesterov": (dt.optim.sgd(0.3, momentum=0.9, nesterov=True, weight_decay=0.01),
                     lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9, nesterov=True,
                                               weight_decay=0.01)),
    "adam": (dt.optim.adam(0.05, weight_decay=0.01),
             lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.01, foreach=False)),
    "adamw": (dt.optim.adamw(0.05, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1, foreach=False)),
}


@pytest.mark.parametrize("noise", ["table", "generator"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_es_update_from_seeds_and_ranks_equals_the_direct_computation(noise, optimizer):
    config, torch_optimizer = OPTIMIZERS[optimizer]
    source = noise_source(noise, 7, SIZE, 4096 if noise == "table" else None)
    es = EvolutionStrategy(dt.evolve.es(SIGMA, config), POPULATION, seed=7, noise=source)
    theta = np.random.default_rng(0).standard_normal(SIZE).astype(np.float32)
    state = es.initial_state(theta)
    direct = torch.nn.Parameter(torch.from_numpy(theta.copy()).double())
    reference = torch_optimizer([direct])
    rng = np.random.default_rng(1)
    for generation in range(3):
        # The materialised perturbations, and the members they make.
        epsilon = np.stack([source.vector(int(s)) for s in es.seeds(generation)]).astype(
            np.float64)
        member = np.empty(SIZE, np.float32)
        for k in range(POPULATION // 2):
            for index, sign in ((2 * k, 1), (2 * k + 1, -1)):
                es.member(state, generation, index, member)
                np.testing.assert_allclose(member, state.params + sign * SIGMA * epsilon[k],
                                           rtol=1e-6, atol=1e-6)
        fitness = rng.standard_normal(POPULATION)
        ranks = ranks_of(fitness, maximize=True)
        # The paper's estimate, in float64: centred ranks of the raw fitness.
        shaped = np.argsort(np.argsort(fitness)) / (POPULATION - 1) - 0.5
        gradient = (shaped[0::2] - shaped[1::2]) @ epsilon / (POPULATION * SIGMA)
        direct.grad = torch.from_numpy(-gradient)
        reference.step()
        # Only the ranks travel: decode what a worker would receive.
        received = decode_ranks(encode_ranks(ranks), POPULATION)
        state = es.advance(state, generation, received)
        np.testing.assert_allclose(state.params, direct.detach().numpy(), rtol=2e-5,
                                   atol=2e-6)
    assert np.abs(state.params - theta).max() > 1e-2  # it did move


def test_es_ranks_make_the_update_blind_to_the_scale_of_fitness():
    source = noise_source("table", 3, SIZE, 4096)
    es = EvolutionStrategy(dt.evolve.es(SIGMA), POPULATION, seed=3, noise=source)
    fitness = np.random.default_rng(2).standard_normal(POPULATION)
    theta = np.zeros(SIZE, np.float32)
    one = es.advance(es.initial_state(theta), 0, ranks_of(fitness, True))
    other = es.advance(es.initial_state(theta), 0, ranks_of(np.exp(10 * fitness), True))
    lower = es.advance(es.initial_state(theta), 0, ranks_of(-fitness, False))
    assert np.array_equal(one.params, other.params) and np.array_equal(one.params,
                                                                        lower.params)
    assert centered_ranks(ranks_of(fitness, True)).min() == -0.5


def _ga(sigma: float = 0.05) -> GeneticAlgorithm:
    return GeneticAlgorithm(dt.evolve.ga(sigma, parents=3, elite=1), POPULATION, seed=11,
                            noise=noise_source("table", 11, SIZE, 4096),
                            init=lambda seed: initial_parameters(tiny_net, seed))


def test_ga_rebuilt_from_seeds_equals_the_individual_it_encodes():
    ga = _ga()
    state = ga.initial_state()
    rng = np.random.default_rng(4)
    for generation in range(4):
        before = state
        ranks = ranks_of(rng.standard_normal(POPULATION), True)
        state = ga.advance(state, generation, ranks)
        best_first = np.argsort(-ranks, kind="stable")
        assert state.population[0] == before.population[best_first[0]]  # the elite
        assert state.best == before.population[best_first[0]]
        parents = {before.population[i] for i in best_first[:3]}
        assert all(child[:-1] in parents for child in state.population[1:])
    for encoding in state.population:
        assert len(encoding) in (1, 2, 3, 4, 5)
        # Materialised directly: the model under the first seed, plus each mutation.
        expected = initial_parameters(tiny_net, encoding[0])
        noise = noise_source("table", 11, SIZE, 4096)
        for seed in encoding[1:]:
            expected = expected + np.float32(0.05) * noise.vector(seed)
        fresh = _ga()  # nothing cached: built from the initialisation seed on
        assert np.array_equal(fresh.build(encoding), expected)
        assert np.array_equal(ga.build(encoding), expected)  # from a cached ancestor
    assert ga.cache.hits + ga.cache.built > 0


@pytest.mark.parametrize("population", [2, 3, 48, 1000, 70_000])
def test_ranks_travel_in_ceil_log2_bits_each(population):
    ranks = np.random.default_rng(population).permutation(population)
    packed = encode_ranks(ranks)
    assert len(packed) == ranks_size(population) == -(-population * max(
        1, (population - 1).bit_length()) // 8)
    assert np.array_equal(decode_ranks(packed, population), ranks)


def test_a_generations_record_and_results_decode_to_what_was_sent():
    rng = np.random.default_rng(5)
    history = [rng.permutation(48) for _ in range(3)]
    record = encode_record("0123456789abcdef", 12, 9, 6, [encode_ranks(r) for r in history])
    assert len(record) == 20 + 3 * 36  # a 20-byte header, 6 bits a member
    header = decode_record(record)
    assert (header.run_key, header.generation, header.base) == ("0123456789abcdef", 12, 9)
    assert header.members(7, 48) == (42, 48) and header.members(2, 45) == (12, 18)
    for g, ranks in enumerate(history, start=9):
        assert np.array_equal(header.ranks_of(g, 48), ranks)
    values = rng.standard_normal(6)
    me = worker_id("tcp://127.0.0.1:4321")
    plain, checked = (encode_result(values, 0.25, me, c) for c in (None, 2**32 - 1))
    assert (len(plain), len(checked)) == (36, 40)  # 6 float32, seconds, id (+ checksum)
    for data, checksum in ((plain, None), (checked, 2**32 - 1)):
        answer = decode_result(data, 6)
        assert np.array_equal(answer.values, values.astype(np.float32))
        assert (answer.seconds, answer.worker, answer.checksum) == (0.25, me, checksum)
    with pytest.raises(ValueError, match="a result of 4 members has 28 or 32 bytes, not 36"):
        decode_result(plain, 4)


def test_algorithm_settings_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="population must be even for ES"):
        dt.evolve.es().check_population(7)
    with pytest.raises(ValueError, match="the ES update runs sgd, adam, adamw; got "
                                         "optimizer 'lars'"):
        dt.evolve.es(optimizer=dt.optim.lars(0.1))
    with pytest.raises(ValueError, match="sigma must be a positive number"):
        dt.evolve.ga(sigma=0)
    with pytest.raises(ValueError, match=r"elite \(8\) must be smaller than the population"):
        dt.evolve.ga(elite=8).check_population(8)
    with pytest.raises(ValueError, match="unknown algorithm 'cma'"):
        dt.evolve.get_algorithm("cma")
    with pytest.raises(ValueError, match="noise_size 10 is smaller than the model's 37"):
        noise_source("table", 0, SIZE, 10)
