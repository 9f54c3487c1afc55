"""Triton model repositories: ``config.pbtxt`` (or a model file Triton's auto-complete
recognises), numbered version folders, ensembles, sequence batching, the Python backend."""
