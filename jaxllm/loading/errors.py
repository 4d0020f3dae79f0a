class LoadError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""
