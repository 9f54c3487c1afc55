"""The way HTTP calls cross from the front processes to the engine process (no torch, no HTTP
framework): ASGI events in frames over one Unix socket per front."""
