"""Tests for layerwave.selection: the strategies and their objective on synthetic statistics."""

import itertools

import numpy as np
import pytest

from layerwave import layer_ids
from layerwave import selection
from layerwave.analysis import compartments
from layerwave.layer_ids import LayerSelection

L = 12


def _stats(seed=0):
  rng = np.random.default_rng(seed)
  e = rng.random(L + 1)
  a = rng.random((L + 1, L + 1))
  c = (a + a.T) / 2
  np.fill_diagonal(c, 1.0)
  return e, c


def _objective(ids, e_hat, c, lam):
  return sum(e_hat[i] for i in ids) - lam * sum(c[a, b] for a, b in itertools.combinations(ids, 2))


def test_eagle3_strategy():
  sel = selection.select_layers("eagle3", num_layers=30, hidden_size=576)
  assert sel.ids == (2, 15, 27) and sel.strategy == "eagle3" and sel.hidden_size == 576
  assert sel.block_output_ids() == (1, 14, 26)


@pytest.mark.parametrize("k,lam,min_gap", [(1, 1.0, 0), (3, 1.0, 0), (3, 0.3, 3), (4, 2.0, 2)])
def test_exhaustive_equals_brute_force(k, lam, min_gap):
  e, c = _stats(k)
  sel = selection.select_layers("exhaustive", e, c, k=k, lam=lam, min_gap=min_gap)
  cands = list(range(1, L))
  e_hat = (e - e[cands].min()) / (e[cands].max() - e[cands].min())
  best = max((s for s in itertools.combinations(cands, k)
              if all(b - a >= min_gap for a, b in zip(s, s[1:]))),
             key=lambda s: _objective(s, e_hat, c, lam))
  assert sel.ids == best
  assert sel.scores["objective"] == pytest.approx(_objective(best, e_hat, c, lam))


def test_entropy_strategy_top_k_and_gap():
  e = np.zeros(L + 1)
  e[[3, 4, 9, 0, L]] = [5.0, 4.9, 4.0, 100.0, 100.0]  # 0 and L are not candidates by default
  assert selection.select_layers("entropy", e, k=3).ids == (3, 4, 9)
  assert selection.select_layers("entropy", e, k=2, min_gap=2).ids == (3, 9)
  assert selection.select_layers("entropy", e, k=1, include_embeddings=True).ids == (0,)
  assert selection.select_layers("entropy", e, k=1, include_final=True).ids == (L,)


def test_greedy_picks_known_layers():
  e = np.linspace(0, 1, L + 1)
  e[5] = 2.0  # most informative
  c = np.full((L + 1, L + 1), 0.1)
  c[5, 6] = c[6, 5] = c[5, 4] = c[4, 5] = 0.99  # neighbours of 5 are redundant with it
  np.fill_diagonal(c, 1.0)
  sel = selection.select_layers("greedy", e, c, k=3, lam=1.0)
  # After 5: the next highest Ê are 11, 10 (not redundant).
  assert sel.ids == (5, 10, 11)
  sel = selection.select_layers("greedy", e, c, k=2, lam=1.0, candidates=[4, 5, 6, 7])
  assert sel.ids == (5, 7)


def test_compartment_strategy_one_per_block():
  e, c = _stats(3)
  blocks = [(1, 4), (4, 8), (8, 12)]
  sel = selection.select_layers("compartment", e, c, k=3, compartments=blocks)
  labels = [next(i for i, (s, t) in enumerate(blocks) if s <= x < t) for x in sel.ids]
  assert sorted(labels) == [0, 1, 2]
  for x, (s, t) in zip(sel.ids, blocks):
    assert e[x] == e[s:t].max()  # best Ê in each compartment
  sel2 = selection.select_layers("compartment", e, c, k=2, compartments=blocks)
  assert len({next(i for i, (s, t) in enumerate(blocks) if s <= x < t) for x in sel2.ids}) == 2
  with pytest.raises(ValueError, match="compartments"):
    selection.select_layers("compartment", e, c, k=3, compartments=[(1, 6), (6, 12)])


def test_compartment_strategy_needs_its_blocks():
  e, c = np.arange(L + 1, dtype=float), np.eye(L + 1)
  with pytest.raises(ValueError, match="selection_blocks"):
    selection.select_layers("compartment", e, c, k=3)


def test_compartment_strategy_automatic_blocks():
  c = np.full((L + 1, L + 1), 0.1)
  for s, t in [(1, 5), (5, 8), (8, 12)]:
    c[s:t, s:t] = 0.95
  np.fill_diagonal(c, 1.0)
  e = np.arange(L + 1, dtype=float)
  blocks = compartments.selection_blocks(c, layer_ids.default_candidates(L), 3)
  sel = selection.select_layers("compartment", e, c, k=3, compartments=blocks)
  assert sel.ids == (4, 7, 11)
  assert sel.scores["compartments"] == [[1, 5], [5, 8], [8, 12]]


def test_random_is_seeded_and_respects_gap():
  a = selection.select_layers("random", num_layers=L, k=3, seed=7, min_gap=3)
  b = selection.select_layers("random", num_layers=L, k=3, seed=7, min_gap=3)
  assert a.ids == b.ids and a.seed == 7
  assert all(y - x >= 3 for x, y in zip(a.ids, a.ids[1:]))
  assert all(1 <= i <= L - 1 for i in a.ids)


def test_selection_errors():
  e, c = _stats()
  with pytest.raises(ValueError, match="unknown layer-selection strategy.*eagle3, entropy, greedy"):
    selection.select_layers("best", e, c)
  with pytest.raises(ValueError, match="exceeds"):
    selection.select_layers("exhaustive", e, c, k=L)
  with pytest.raises(ValueError, match="infeasible under min_gap"):
    selection.select_layers("exhaustive", e, c, k=4, min_gap=4)
  with pytest.raises(ValueError, match="k must be"):
    selection.select_layers("entropy", e, c, k=0)
  with pytest.raises(ValueError, match="needs the CKA"):
    selection.select_layers("greedy", e, None)
  with pytest.raises(ValueError, match="shape"):
    selection.select_layers("greedy", e, c[:-1, :-1])
  with pytest.raises(ValueError, match="NaN"):
    selection.select_layers("entropy", np.full(L + 1, np.nan))


def test_a_strategy_record_round_trips(tmp_path):
  e, c = _stats()
  sel = selection.select_layers("exhaustive", e, c, k=3, hidden_size=64, data_hash="abc123",
                                config={"alpha": 1.0})
  path = tmp_path / "layers.json"
  sel.save(path)
  assert LayerSelection.load(path, num_layers=L, hidden_size=64) == sel
  assert sel.data_hash == "abc123" and sel.config["alpha"] == 1.0 and sel.config["k"] == 3
