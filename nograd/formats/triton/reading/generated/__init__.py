"""Triton's ``model_config.proto`` and its generated module; see README.md here."""
