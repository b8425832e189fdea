"""The run directory, the one contract between the stages: meta.json, the chunked Arrow spool (schemas,
writer, crash-tolerant reader) and `load_run`, which the analysis reads."""
