"""The serving core every transport calls: the data plane over the loaded models."""
