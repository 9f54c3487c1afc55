"""nograd's model schema: what a model is (its config, tensors, versions, ensemble steps,
sequence batching), read from any model format and needed by every layer above, without torch.

The fronts, the model formats' readers and the serving core validate against it in a process
that never loads torch; the runtime builds its models from it.
"""
