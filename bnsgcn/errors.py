"""The one exception type that reaches users as a one-line message."""


class UserError(Exception):
    """Bad input or environment: the message names the problem and the fix.

    Command-line entry points print ``error: <message>`` and exit with status 2
    (a traceback only with ``--debug``).
    """
