"""What serves a Triton model: the Python backend's ``model.py`` in nograd's process, an artifact
backend's file on its engine, and the config's ``model_warmup`` run at load."""
