"""One module per workflow stage: ingest, regenerate, prepare, extract, consolidate, train, export, evaluate."""
