"""The error every launcher-side check raises, and its hint: below the config schema (finetune.config
re-exports both), so that the records the schema reads (finetune/optimizers/) can raise it too without
importing the schema back.
"""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A user mistake in the config: the message is one line that says what to change."""


def did_you_mean(word: str, options: list[str], prefix: str = "") -> str:
    """" (did you mean 'PREFIXx'?)" for the option closest to `word`, or "" when none is close."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""
