"""The one error type of checkpoint saving and loading."""


class CheckpointError(ValueError):
    """A checkpoint cannot be written in the requested format, or a folder does not hold what loading needs
    (a tensor missing, of the wrong shape or dtype, a non-finite scale, a truncated file). The message names
    the tensor or module and what to do."""
