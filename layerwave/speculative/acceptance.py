"""What a draft should accept, predicted the way it was trained: the check that ties the loop to training.

The speculative loop (`decode.py`) runs the draft against a KV cache it fills itself; training runs the same
draft as the unrolled training-time test (TTT, `training/losses.py`) over whole sequences with no cache. At
T = 0 every token the loop emits is the target's greedy token, so along the target's greedy continuation x
the two computations must agree: with committed length n, a greedy chain of K drafts accepts

    m(n) = number of leading steps j < K with pred[j, n-1] == x[n+1+j]

where `pred[j, t]` is the TTT prediction of step j at position t (it predicts x_{t+2+j}). The loop's
`accept_lengths` must equal the sequence m(n_0), m(n_1), ... with n_0 = prompt length and
n_{i+1} = n_i + m(n_i) + 1. The same predictions give two estimates of τ on that text:

* `positional_tau`: the mean of 1 + m(n) over every start n of the continuation (what a loop that started
  at a random position would see);
* `marginal_tau`: 1 + Σ_j Π_{i<=j} acc_i from the per-step accuracies alone (training's `simulated_tau`,
  which treats the steps as independent).

`benchmarks/check_acceptance.py` runs this on a real target and draft; the tests run it on a tiny one.

Legend (`layerwave.axes`): B batch, T tokens, K draft depth (the TTT steps).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerwave.inference import Target
from layerwave.models.draft import Draft


@functools.partial(nnx.jit, static_argnames=("steps",))
def _ttt_argmax(draft: Draft, features, tokens, mask, *, steps: int):
  """`[B, K, T]` target ids of the draft's top-1 at each TTT step (inputs as in `losses.ttt_loss`)."""
  t = tokens.shape[1]
  padded = jnp.pad(tokens, ((0, 0), (0, steps + 1)))
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens.shape)
  diag = draft.ttt_init(tokens.shape[0], t, steps)
  h, base, preds = draft.fuse(features), None, []
  for j in range(steps):
    inputs = jax.lax.dynamic_slice_in_dim(padded, j + 1, t, axis=1)
    h, logits, new_base, diag = draft.ttt_step(h, inputs, positions + j, jnp.asarray(j), base, diag,
                                               mask)
    base = new_base if base is None else base
    preds.append(draft.draft_to_target(jnp.argmax(logits, -1)).astype(jnp.int32))
  return jnp.stack(preds, axis=1)


def teacher_forced_predictions(target: Target, draft: Draft, sequences: Sequence[Sequence[int]],
                               steps: int, batch_size: int = 8) -> list[np.ndarray]:
  """The draft's TTT top-1 predictions along each sequence.

  Args:
    target: the loaded target (its features at the draft's layers are read with a plain forward).
    draft: the draft.
    sequences: token ids (e.g. prompt + the target's greedy continuation).
    steps: K, the TTT steps to unroll.
    batch_size: sequences per call (right-padded: positions before the padding never read it).

  Returns:
    Per sequence, `[K, T]` target ids: entry `[j, t]` predicts token t + 2 + j.
  """
  draft.config.check_target(target.config)
  ids = np.asarray(draft.config.layer_ids)
  width = max(len(s) for s in sequences)
  out = []
  for start in range(0, len(sequences), batch_size):
    chunk = sequences[start:start + batch_size]
    tokens = np.zeros((batch_size, width), np.int32)  # one shape for every call
    mask = np.zeros_like(tokens)
    for i, s in enumerate(chunk):
      tokens[i, :len(s)], mask[i, :len(s)] = s, 1
    mask[len(chunk):, 0] = 1  # filler rows read one token
    feats = target.forward(tokens, mask, return_hidden_states=True).hidden_states[ids]
    preds = np.asarray(_ttt_argmax(draft, feats, jnp.asarray(tokens), jnp.asarray(mask),
                                   steps=int(steps)))
    out.extend(p[:, :len(s)] for p, s in zip(preds, chunk))
  return out


def leading_matches(preds: np.ndarray, sequence: np.ndarray, n: int, k: int) -> int:
  """m(n): drafted tokens a greedy chain of K = `k` accepts at committed length n."""
  sequence = np.asarray(sequence)
  if n + k >= len(sequence):
    raise ValueError(f"The sequence ({len(sequence)} tokens) must extend k + 1 = {k + 1} tokens past "
                     f"the committed length {n}; generate a longer greedy continuation.")
  match = preds[:k, n - 1] == sequence[n + 1:n + 1 + k]
  return int(np.cumprod(match).sum())


def predicted_chain_acceptance(preds: np.ndarray, sequence: Sequence[int], prompt_len: int, k: int,
                               max_new_tokens: int) -> list[int]:
  """The accepted lengths a greedy chain loop must report for one prompt (`accept_lengths`).

  The loop's prefill emits one token; each verification emits m + 1 while fewer than `max_new_tokens`
  have been emitted.
  """
  expected, n = [], int(prompt_len)
  while n - prompt_len + 1 < max_new_tokens:
    m = leading_matches(preds, np.asarray(sequence), n, k)
    expected.append(m)
    n += m + 1
  return expected


def tau_estimates(preds: np.ndarray, sequence: Sequence[int], prompt_len: int, k: int,
                  max_new_tokens: int) -> dict[str, float | list[float]]:
  """τ predicted from the teacher-forced predictions over the continuation's start positions.

  Returns:
    {"positional_tau": mean of 1 + m(n), "marginal_tau": 1 + Σ_j Π_{i<=j} acc_i, "acc": per-step
     top-1 agreement `[K]`, "starts": how many positions n were counted}.
  """
  sequence = np.asarray(sequence)
  starts = np.arange(prompt_len, prompt_len + max_new_tokens - 1)
  m = np.array([leading_matches(preds, sequence, int(n), k) for n in starts])
  hits = np.stack([preds[j, starts - 1] == sequence[starts + 1 + j] for j in range(k)])
  acc = hits.mean(axis=1)
  return {"positional_tau": float(np.mean(m + 1)), "marginal_tau": float(1 + np.cumprod(acc).sum()),
          "acc": acc.tolist(), "starts": int(len(starts))}
