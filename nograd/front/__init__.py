"""A front process: HTTP connections served without torch, each call forwarded to the engine
process over the bridge (``nograd.bridge``)."""
