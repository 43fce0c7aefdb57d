"""Registration of the long-running commands (sidecar, serve, demo) on the CLI parser."""

REGISTRARS: list = []
