"""Engines besides torch eager: PyTorch 2 artifacts and ONNX Runtime, built, checked, picked."""
