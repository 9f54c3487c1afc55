"""Triton's protocol extensions in the serving core: shared memory, sequences, ensembles,
documents, trace and log settings."""
