"""Finding the app of `qmq worker -A module:app` (Celery's `-A`): `module` is imported, `app` is an
attribute of it (a dotted path works too); `-A module` alone looks for an attribute named `app`."""

from __future__ import annotations

import importlib

from worker.app import App


class AppNotFound(Exception):
    pass


def load_app(spec: str) -> App:
    module_name, _, attribute = spec.partition(":")
    attribute = attribute or "app"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise AppNotFound(
                f"cannot import {module_name!r} (is the current directory or PYTHONPATH right?)"
            ) from None
        raise
    value: object = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise AppNotFound(f"module {module_name!r} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not isinstance(value, App):
        raise AppNotFound(f"{spec} is a {type(value).__name__}, not a qmq.App")
    return value
