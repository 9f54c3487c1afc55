"""Wire formats as pure codecs: the Open Inference Protocol (JSON and binary tensors) and its
schemas."""
