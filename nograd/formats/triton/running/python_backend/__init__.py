"""Triton's Python backend: a ``model.py`` defining ``TritonPythonModel``, run in nograd's own
process with nograd's implementation of ``triton_python_backend_utils`` (``utils``)."""
