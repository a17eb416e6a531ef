"""The one exception type of the converter: bad input, named precisely."""

from __future__ import annotations


class ConversionError(ValueError):
    """A checkpoint or config cannot be converted; the message names the file, tensor or field."""
