"""Model control: the repository on disk, loads, reloads, unloads and uploads, kept alike in
every worker."""
