"""``edgeinfer serve``: an OpenAI-compatible local server for one model (Starlette +
uvicorn, the ``serve`` extra, imported only when serving).

A request travels through these modules, in this order:

- ``app``: ``create_app`` — the routes and the middleware, nothing else.
- ``guard``: who may talk to the server — the Host/Origin check against DNS rebinding and
  cross-site pages (403 before any route runs), and the API key compared as bytes.
- ``endpoints``: one small function per route, each taking the frozen ``Context``
  (model, ``ServerConfig``, queue, access log, key).
- ``body``: the request body read within ``max_body_bytes`` and parsed with bounds.
- ``wire``: OpenAI's wire format — request fields checked one by one (``WireError`` names
  the field), and the response objects built from edgeinfer's chunks and stats.
- ``admission``: the first-come, first-served queue in front of the model (503 past
  ``max_queue``) and ``admit``, which turns a checked request into a queued job.
- ``jobs``: one worker thread per admitted request, running the model's token stream and
  handing its chunks to the event loop; cancellable from any thread.
- ``delivery``: the ASGI reply that follows a job to its end (the status line waits for
  the first token, so a request that fails before it gets an honest status);
  ``connection`` watches the client and sends, ``streaming`` writes server-sent events.
- ``replies``: the error bodies (one function per refusal) and the access log.
- ``config``: ``ServerConfig``, the settings fixed at start.

``/v1/responses`` runs as a chat request through the same path: ``responses`` and
``response_items`` read its body and input items into chat messages, ``response_objects``
builds the response and its items, ``response_stream`` writes OpenAI's Responses events,
``response_store`` keeps responses for ``previous_response_id`` (bounded, in memory) and
``response_routes`` answers ``GET``/``DELETE /v1/responses/{id}``. ``embeddings`` answers
``/v1/embeddings`` (``embedding_ids``: token-id inputs).

The ``serve`` command itself (flags, start-up checks, uvicorn's lifecycle) is
``edgeinfer/cli/serve.py``: this package never imports the CLI.
"""
