"""TorchServe's documents and management calls (describe, list, register, scale, unregister)."""
