"""A model format that exists only for the format table's test: the whole of a format is this
one sub-package (``format``: torch-free, ``running``: what serves it) and one row."""
