"""Stubs generated from Triton's protos; see README.md here."""
