"""The main job's user-facing failure: one line for the user, and the exit status."""


class JobError(Exception):
    """Bad input or a missing part: `qcompress train` prints the message and exits with `code`
    (2 for bad input, 1 for a missing optional package)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code
