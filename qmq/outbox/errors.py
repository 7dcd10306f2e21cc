"""What `producer.send` raises when it cannot know the application's transaction."""

from __future__ import annotations


class NotInTransaction(RuntimeError):
    """`send` was called outside any transaction its Producer can join: its message could neither
    commit nor roll back with the caller's work, so it is refused. The message says how to fix it."""
