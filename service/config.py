"""Configuration: defaults, then environment variables, then the mapping passed to ``create_app``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Largest request body accepted; 10,000 observations with a few metrics fit comfortably.
DEFAULT_MAX_CONTENT_LENGTH = 16 * 1024 * 1024


class ConfigurationError(ValueError):
    """A setting (environment variable or ``create_app`` mapping) pasto cannot use.

    The message names the setting and says what it must be; ``pasto`` prints it as
    ``pasto: error: ...`` instead of a traceback.
    """


def load_config(instance_path: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Resolve the service configuration.

    Keys: ``PASTO_DATABASE_URL`` (SQLAlchemy URL, default ``sqlite:///<instance>/pasto.sqlite``),
    ``PASTO_ADMIN_TOKEN`` (bootstrap admin token, kept only as its SHA-256 digest),
    ``PASTO_SCHEDULER_INTERVAL`` (seconds between round checks, default 1),
    ``PASTO_CHECK_SCHEMA`` (refuse to start on an un-migrated database, default true),
    ``PASTO_VERSION_CHECK_SECONDS`` (how stale a worker's cached experiment may be, default 0.05),
    ``PASTO_ANONYMOUS_LOOPBACK_READ`` (let requests from 127.0.0.1/::1 read without a token, default
    false: for a dashboard on the same machine, never behind a reverse proxy on that machine),
    ``MAX_CONTENT_LENGTH`` (bytes).
    """
    config: dict[str, Any] = {
        "PASTO_DATABASE_URL": f"sqlite:///{Path(instance_path) / 'pasto.sqlite'}",
        "PASTO_ADMIN_TOKEN": None,
        "PASTO_SCHEDULER_INTERVAL": 1.0,
        "PASTO_CHECK_SCHEMA": True,
        "PASTO_VERSION_CHECK_SECONDS": 0.05,
        "PASTO_ANONYMOUS_LOOPBACK_READ": False,
        "MAX_CONTENT_LENGTH": DEFAULT_MAX_CONTENT_LENGTH,
    }
    for key in ("PASTO_DATABASE_URL", "PASTO_ADMIN_TOKEN", "PASTO_SCHEDULER_INTERVAL", "PASTO_VERSION_CHECK_SECONDS"):
        if os.environ.get(key):
            config[key] = os.environ[key]
    if os.environ.get("PASTO_ANONYMOUS_LOOPBACK_READ"):
        config["PASTO_ANONYMOUS_LOOPBACK_READ"] = _flag("PASTO_ANONYMOUS_LOOPBACK_READ",
                                                        os.environ["PASTO_ANONYMOUS_LOOPBACK_READ"])
    if overrides:
        config.update(overrides)
    try:
        config["PASTO_SCHEDULER_INTERVAL"] = float(config["PASTO_SCHEDULER_INTERVAL"])
    except (TypeError, ValueError) as error:
        raise ConfigurationError(
            f"PASTO_SCHEDULER_INTERVAL must be a number of seconds, got {config['PASTO_SCHEDULER_INTERVAL']!r}."
        ) from error
    if not config["PASTO_SCHEDULER_INTERVAL"] > 0:
        raise ConfigurationError("PASTO_SCHEDULER_INTERVAL must be a positive number of seconds.")
    try:
        config["PASTO_VERSION_CHECK_SECONDS"] = float(config["PASTO_VERSION_CHECK_SECONDS"])
    except (TypeError, ValueError) as error:
        raise ConfigurationError("PASTO_VERSION_CHECK_SECONDS must be a number of seconds.") from error
    if not config["PASTO_VERSION_CHECK_SECONDS"] >= 0:
        raise ConfigurationError("PASTO_VERSION_CHECK_SECONDS must be zero or a positive number of seconds.")
    return config


def _flag(key: str, text: str) -> bool:
    value = text.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ConfigurationError(f"{key} must be 1/true/yes/on or 0/false/no/off, got {text!r}.")
