"""TorchServe's default handlers that nograd provides, by the names archives give them."""
