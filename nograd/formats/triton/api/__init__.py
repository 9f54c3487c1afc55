"""The documents Triton answers for its models: model configuration and repository index."""
