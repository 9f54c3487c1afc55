"""The torch side of nograd: model configs, loading, devices, memory, precision."""
