"""The one exception type for problems a user can cause and fix."""


class GptlabError(Exception):
    """Bad input, a missing file, an impossible setting: the message is one sentence saying what is wrong and
    how to fix it. The CLI prints it on one line and exits with code 2; internal invariants use assertions."""
