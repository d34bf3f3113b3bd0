"""``edgeinfer chat --session NAME``: a conversation that outlives the process.

The session lives in ``$EDGEINFER_HOME/sessions/NAME/``: ``messages.json`` (the conversation)
and ``state.kvs`` (the model's KV snapshot after the last reply, ``Model.save_state``). Both
are written atomically after every reply; on start the messages are read back (bounded, checked)
and the snapshot restored, so the next turn reads only what is new. A snapshot that does not
fit (another model or settings, a damaged file) is set aside with one line on stderr: the
conversation then is read again, never answered from a wrong cache.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from ..bounded_json import read_json_file
from ..errors import InvalidRequestError, SnapshotError
from ..files.catalog import edgeinfer_home

__all__ = ["SessionFiles"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MAX_MESSAGES_BYTES = 16 << 20
_MAX_MESSAGES = 10_000


class SessionFiles:
    """Where session ``name`` is kept, and its messages and KV read and written."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):  # "$" would take a "\n"
            raise InvalidRequestError(
                f"--session {name!r:.80} is invalid: use 1 to 64 letters, digits, '_', '-' or "
                "'.', starting with a letter or digit"
            )
        self.folder = edgeinfer_home() / "sessions" / name
        self.messages_path = self.folder / "messages.json"
        self.state_path = self.folder / "state.kvs"

    def read_messages(self) -> list[dict[str, str]] | None:
        """The saved conversation; None when the session is new."""
        if not self.messages_path.exists():
            return None
        value = read_json_file(
            self.messages_path, max_bytes=_MAX_MESSAGES_BYTES, error=InvalidRequestError
        )
        if (
            not isinstance(value, list)
            or len(value) > _MAX_MESSAGES
            or not all(
                isinstance(m, dict)
                and set(m) == {"role", "content"}
                and m["role"] in ("system", "user", "assistant")
                and isinstance(m["content"], str)
                for m in value
            )
        ):
            raise InvalidRequestError(
                f"{self.messages_path} is not a saved conversation (a list of role/content "
                "messages); delete the session folder to start it again"
            )
        return value

    def restore(self, model: Any) -> None:
        """Restore the KV snapshot into ``model``, if there is one that fits."""
        if not self.state_path.exists():
            return
        try:
            model.load_state(self.state_path)
        except SnapshotError as exc:
            print(f"edgeinfer: the conversation is read again: {exc}", file=sys.stderr)

    def save(self, model: Any, messages: list[dict[str, str]]) -> None:
        """Write the messages and the model's KV; a failure (a full disk) is one line."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.messages_path.with_name(f".messages.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(messages, ensure_ascii=False), encoding="utf-8")
            os.replace(tmp, self.messages_path)
            model.save_state(self.state_path)
        except (OSError, SnapshotError, InvalidRequestError) as exc:
            print(f"edgeinfer: the session was not saved: {exc}", file=sys.stderr)

    def clear(self) -> None:
        for path in (self.messages_path, self.state_path):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
