"""On-disk formats: hidden-state shards and their headers, atomic writes, the draft vocabulary."""
