"""Speculative decoding with an EAGLE-3 draft: the last stage of the pipeline (docs/METHOD.md §8).

  generate(target, draft, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, **draft_options)
      → (new-token lists, metrics); draft_options: method="chain" | "tree", num_draft_tokens,
      tree_depth, tree_top_k, tree_tokens, draft_sample.
"""

from layerwave.speculative.decode import LoadedDraft, SpecOptions, SpecState, generate
from layerwave.speculative.tree import Tree, TreeBudget
from layerwave.speculative.verify import Acceptance

__all__ = ["Acceptance", "LoadedDraft", "SpecOptions", "SpecState", "Tree", "TreeBudget", "generate"]
