"""Errors with messages that say what failed, where, and what to do."""

from __future__ import annotations


class MedflareError(Exception):
    """Base class: every error medflare raises on purpose derives from it."""


class ConfigError(MedflareError, ValueError):
    """A configuration value is unknown, missing or out of range."""


class DataError(MedflareError, ValueError):
    """Input data is missing, unreadable, or disagrees with the declared task."""


class PayloadError(MedflareError, ValueError):
    """A message between site and server breaks the method's declared payload contract."""


class SiteDeclined(MedflareError):
    """A site declines a task on its own policy (e.g. its DP-SGD budget is spent); the one-line reason is all the
    site sends back, and the server records it beside the site's failed task."""
