"""One error type for everything a user can cause.

The CLI prints `error: <cause>` and `fix: <fix>` and exits non-zero; library callers
catch `DuokaError` and read the two fields. Bugs in duoka itself stay ordinary
exceptions with tracebacks, so they are not mistaken for user errors.
"""


class DuokaError(Exception):
    def __init__(self, cause: str, fix: str | None = None):
        super().__init__(cause if fix is None else f"{cause}\n  fix: {fix}")
        self.cause = cause
        self.fix = fix

    def __reduce__(self):  # raised in a worker process, it must arrive whole in the parent
        return (type(self), (self.cause, self.fix))
