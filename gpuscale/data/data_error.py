"""The one error of loading a data set (data/tasks.py and the loaders it calls): its message is one
line that says why and what to do; the front ends print it and exit 2, a rank makes it its error."""


class DataError(ValueError):
    """A data set that cannot be loaded; the message is one line that says why and what to do."""
