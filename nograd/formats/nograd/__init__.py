"""nograd's own model folders: ``config.toml`` or ``config.yaml`` (``nograd.schema.config``)
beside the model's code and weights, or an engine's artifact."""
