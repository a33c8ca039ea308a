"""The merge engine, pure and usable alone: it imports nothing of the rest of Layerswap, sees
local directories and takes a frozen options object, never settings.

The pipeline, as the folders show it (each imports only what stands above it here):

- ``errors``, ``limits``, ``progress``: the vocabulary every stage shares.
- ``architectures``: model families, where their layer stacks and vocabularies are.
- ``schema/``: what a recipe is made of (sources, output options, per-layer settings, bounded
  YAML).
- ``io/``: files (confinement, safetensors, checkpoints, the atomic writer, digests).
- ``plan/``: the plan, per output tensor its op and terms, and the checks made on it.
- ``kernels/``: the arithmetic that turns a planned tensor into output bytes.
- ``vocabulary/``: aligning checkpoints whose vocabularies differ.
- ``analysis/``: per-layer deltas between experts, swap suggestions, heatmaps.
- ``translation/``: a mergekit config as a method reads it (its inputs, its parameters resolved
  as mergekit resolves them) and what a method declares of its mergekit counterpart.
- ``methods/``: one module per merge method (its schema, rule, formula, mergekit translation),
  and the registry of them.
- ``recipe``: the recipe, every registered method's schema in one union.
- ``planner`` (recipe → plan), ``streaming`` (read → compute → write), ``model_card``.
- ``mergekit/``: the mergekit front end: a config read, its method picked by name from the
  registry, tokenizer and origin handled, the methods not supported yet refused.
- ``merge``: the entry point, a recipe run end to end.

import-linter (pyproject.toml) holds this order.
"""
