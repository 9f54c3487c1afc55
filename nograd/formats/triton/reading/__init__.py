"""A Triton model folder read into nograd's model config.

Triton's ``config.pbtxt`` is protobuf text of its ``model_config.proto``: this package alone
(besides the gRPC transport) imports protobuf, so the serving core reads a Triton folder without
knowing protobuf, and the message's one generated module serves both.
"""
