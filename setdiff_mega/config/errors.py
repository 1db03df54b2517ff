"""The configuration error every section raises (one line naming the field and the fix)."""


class ConfigError(ValueError):
    """A configuration problem; the message names the field and the fix."""


__all__ = ["ConfigError"]
