"""The gRPC transport: the Open Inference Protocol's gRPC service over the same data plane."""
