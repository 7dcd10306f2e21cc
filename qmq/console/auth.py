"""Who may act: reading the console needs nothing, acting (re-drive, purge, reset) needs the token
the servers use (QMQ_TOKEN), typed once into the sign-in form and kept in the signed session
cookie. Without a token configured anywhere, anyone who reaches the console may act (the pages say
so), unless it runs --read-only. Every form that acts carries a CSRF token bound to the session.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import MutableMapping
from typing import Any

from werkzeug.exceptions import BadRequest

SIGNED_IN = "signed_in"
CSRF = "csrf"


class Access:
    def __init__(self, token: str | None, read_only: bool = False) -> None:
        self.token = token or None
        self.read_only = read_only

    @property
    def open(self) -> bool:
        """No token: acting needs no sign-in."""
        return self.token is None

    def can_act(self, session: MutableMapping[str, Any]) -> bool:
        return not self.read_only and (self.open or bool(session.get(SIGNED_IN)))

    def sign_in(self, session: MutableMapping[str, Any], given: str) -> bool:
        """True (and the session signed in) when `given` is the token."""
        if self.token is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            return False
        session[SIGNED_IN] = True
        session[CSRF] = secrets.token_urlsafe(24)  # a new session secret once signed in
        return True

    @staticmethod
    def sign_out(session: MutableMapping[str, Any]) -> None:
        session.clear()

    @staticmethod
    def csrf_token(session: MutableMapping[str, Any]) -> str:
        if CSRF not in session:
            session[CSRF] = secrets.token_urlsafe(24)
        return session[CSRF]

    @staticmethod
    def check_csrf(session: MutableMapping[str, Any], given: str | None) -> None:
        expected = session.get(CSRF)
        if not expected or not given or not hmac.compare_digest(expected.encode(), given.encode()):
            raise BadRequest("the form is stale or did not come from this console: reload the page and try again")
