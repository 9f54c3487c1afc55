"""An archive's files: the zip unpacked within its bounds, its manifest and model-config.yaml."""
