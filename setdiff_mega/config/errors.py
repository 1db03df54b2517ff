"""The configuration error every section raises (one line naming the field and the fix)."""
from setdiff_mega.errors import ConfigError

__all__ = ["ConfigError"]
