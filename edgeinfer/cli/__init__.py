"""The ``edgeinfer`` command: the edge of the package, never imported by the core.

- ``main``: the parser and the dispatch, nothing else (``main()`` is the console script).
- ``common``: what the commands share: the model, sampling and chat-template flags,
  ``load_model``, the figures line, logging, and errors as one line on stderr (status 1).
- one module per command, each with ``add_parser(sub)`` and ``cmd_<name>(args)``: ``run``,
  ``chat``, ``models``, ``convert``, ``devices``, ``serve``, ``bench``, ``batch``, ``embed``. No
  command module imports another.
"""

from .main import main

__all__ = ["main"]
