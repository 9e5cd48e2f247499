"""The one error type of the data pipeline."""


class DataError(ValueError):
    """Bad data or data settings; the message names the problem and the fix."""
