"""The torch side of nograd: model loading, devices, memory, precision, engines."""
