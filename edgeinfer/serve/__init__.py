"""``edgeinfer serve``: an OpenAI-compatible local server for one model (Starlette +
uvicorn, the ``serve`` extra, imported only when serving)."""
