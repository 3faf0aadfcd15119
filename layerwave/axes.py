"""The one legend of axis letters: what every shape in layerwave's docstrings and comments means.

A shape is written in brackets, `[L+1, B, T, D]`; a module that writes shapes cites this module and lists
the letters it uses on its `Legend` line, each with the short name given here (`LETTERS`). The letters are
case-sensitive and each means one thing everywhere:

Target and draft models
  B    batch: sequences (rows) in one call.
  T    tokens: the positions of a sequence, or the new tokens of one call against a KV cache (a prompt's
       prefill, one decoding step, or a verification: the pending token plus N drafted nodes, T = N + 1).
  P    prompt width: the padded length of a batch of prompts.
  S    cache slots: the positions a KV cache holds.
  L    target layers: decoder blocks of the target. Hidden states stack L + 1 depths (docs/METHOD.md §1):
       0 = the embedding output, i = the output of block i - 1, L = the final norm's output.
  L1   hidden-state depths: L + 1, as one name where a shape needs it (the analysis accumulators).
  D    target width: the target's hidden size.
  d    draft width: the draft's hidden size.
  V    target vocabulary.
  V_d  draft vocabulary (the draft's reduced one; `d2t` / `t2d` map it to V).
  H    query heads.
  G    key/value heads (grouped-query attention: H is a multiple of G, each key/value head serves H / G
       query heads).
  Dh   head width.

Draft, training and speculation
  k    selected layers: how many target depths the draft reads (`LayerSelection.ids`).
  K    draft depth: tokens drafted in a row. The chain length (`num_draft_tokens`), the tree's depth
       (`tree_depth`), or the unrolled training-time-test steps (`train.ttt_steps`); one verification
       accepts at most K drafted tokens.
  N    tree nodes: drafted candidates of one verification (N + 1 with the root, the pending token). A chain
       of K is the tree with N = K.
  W    tree width: children proposed per expanded node, and the beam width (`tree_top_k`).

Analysis
  n    kept tokens: the tokens of one sequence (or one sample) that enter a Gram matrix.
  m    Gram size: the token rows of one Gram block (a padded rung in `entropy`, an HSIC minibatch in `cka`
       and `stats`).
  R    subsample size: tokens kept for the exact CKA (`exact_cka_tokens`).
"""

from __future__ import annotations

# letter -> the short name a module's `Legend` line gives it (tests/axes_test.py checks every module).
LETTERS = {
    "B": "batch",
    "T": "tokens",
    "P": "prompt width",
    "S": "cache slots",
    "L": "target layers",
    "L1": "hidden-state depths",
    "D": "target width",
    "d": "draft width",
    "V": "target vocabulary",
    "V_d": "draft vocabulary",
    "H": "query heads",
    "G": "key/value heads",
    "Dh": "head width",
    "k": "selected layers",
    "K": "draft depth",
    "N": "tree nodes",
    "W": "tree width",
    "n": "kept tokens",
    "m": "Gram size",
    "R": "subsample size",
}
