"""eaglenest: a reproducible Snakemake workflow that trains EAGLE-3 drafters.

Stages live in one module each and talk through files with documented formats
(docs/formats.md): ingest -> prepare -> extract -> consolidate -> train -> export
-> evaluate. `shards` is the only module that reads or writes shard files.
"""

__version__ = "0.1.0"
