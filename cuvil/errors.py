"""The one root of every user-facing error, and its subclasses.

Each subclass says what was wrong, where (file, line, node, op) and what to do;
the CLI prints the message and exits 2 without a traceback.
"""


class CuvilError(Exception):
    """Root of every error Cuvil raises for a user mistake or a bad input."""

    def __init__(self, message, *, hint=None):
        self.message = message
        self.hint = hint
        super().__init__(self.__str__())

    def __str__(self):
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class ConfigError(CuvilError):
    """cuvil.yaml is malformed, has a wrong type, an unknown key or a bad value."""

    def __init__(self, message, *, file=None, line=None, column=None, hint=None):
        self.file, self.line, self.column = file, line, column
        where = ""
        if file is not None:
            where = str(file)
            if line is not None:
                where += f":{line}"
                if column is not None:
                    where += f":{column}"
            where += ": "
        super().__init__(where + message, hint=hint)


class ModelError(CuvilError):
    """The model file cannot be read, or its graph is invalid."""


class UnsupportedOpError(ModelError):
    """A node uses an op (or an op version, or a dtype) Cuvil cannot compile yet."""


class ShapeError(ModelError):
    """Shapes are missing, symbolic without a value, or inconsistent."""


class BuildError(CuvilError):
    """A compile, emission or link step failed."""


class RuntimeFailure(CuvilError):
    """A built library reported an error, or was called with bad arguments."""
