"""The error of a run's own fault, in a module light enough for the command line to import."""


class TrainingError(RuntimeError):
    """A runtime fault of the run itself (divergence, bad resume, a full disk): one line,
    no traceback."""
