"""The one error type of the data pipeline."""


class DataError(ValueError):
    """Bad data or tokenizer input; the message names the file or config key and the fix."""
