"""The model formats nograd serves: its own folders, Triton model repositories, TorchServe
archives. Each is one sub-package, found through one table (``table``), in the same parts:

- ``format``: the object the table's row names (recognises the format's entries, names what
  serves its models), and ``reading``: its files read into nograd's model schema; neither
  imports torch, so a process that never loads torch reads every format;
- ``running``: what builds and runs its models, on the runtime (torch), reached by the
  runtime's loader through the table, never by an import;
- ``api``: its own documents and management calls, over the serving core.
"""
