"""The HTTP transport: the ASGI app, its routes and middlewares, and the uvicorn server around
it."""
