"""The one exception type users of indexed datasets see."""


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair is missing, corrupt, or cannot be built as asked.

    A `ValueError` so that code catching bad input in general still catches it.
    Messages name the file, say what is wrong with it and what to do about it,
    because the usual reader is a person whose training run just stopped.
    """
