"""Errors with messages that say what failed, where, and what to do."""

from __future__ import annotations

import difflib
from typing import Callable, Iterable


def did_you_mean(word: str, choices: Iterable[str], shown: Callable[[str], str] = str) -> str:
    """' (did you mean 'X'?)' for the one of ``choices`` closest to a misspelt ``word`` (``shown`` writes it as the
    user would type it), or "" when none is close: the hint every "unknown ..." line gives."""
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f" (did you mean '{shown(close[0])}'?)" if close else ""


class MedflareError(Exception):
    """Base class: every error medflare raises on purpose derives from it."""


class ConfigError(MedflareError, ValueError):
    """A configuration value is unknown, missing or out of range."""


class DataError(MedflareError, ValueError):
    """Input data is missing, unreadable, or disagrees with the declared task."""


class PayloadError(MedflareError, ValueError):
    """A message between site and server breaks the method's declared payload contract."""


class SiteDeclined(MedflareError):
    """A site declines a task on its own policy (e.g. its DP-SGD budget is spent). The message, with its details,
    stays in the site's log; what the site sends back is only ``reason``, one word of a closed vocabulary
    (``medflare.contracts.DECLINE_REASONS``), which the server records beside the site's failed task."""

    def __init__(self, message: str, reason: str = "policy") -> None:
        super().__init__(message)
        self.reason = reason
