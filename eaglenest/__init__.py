"""eaglenest: a reproducible Snakemake workflow that trains EAGLE-3 drafters.

The package follows the pipeline (docs/formats.md has each file it writes):

- ``stages/``: one module per workflow stage, ingest -> regenerate -> prepare -> extract ->
  consolidate -> train -> export -> evaluate; ``shard_driver`` is the per-shard loop both
  extraction backends share.
- ``training/``: what the train stage puts together: batches, the target's soft labels, the
  TTT objective and its loss, checkpoints, the loop, torchrun.
- ``formats/``: shards and their headers, atomic writes, the draft vocabulary. ``shards`` is
  the only module that reads or writes shard files.
- ``target_model/``: the target model at run time (loading, aux capture, batching), layer ids, and
  its embedding and head read from its weight files.
- ``model/``: the EAGLE-3 drafter (its custom autograd kernels, its attention in training)
  and speculative decoding with it; ``draft_tree`` is a drafting setting (steps, top-k,
  verified tokens), torch-free for the planner.
- ``sglang/``: the SGLang backend: client, server launcher, in-server plugin.
- ``node/``: operating a node: recon, GPU slots, assets, job logs.
- top level: ``settings`` (the schema's defaults), ``layout`` (the results layout), ``plan``
  (sharding and disk estimates for the workflow), ``cli``.
"""

__version__ = "0.1.0"
