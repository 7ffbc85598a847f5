"""The command-line skin: options, device selection, errors, rendering and thin commands.

Importing this package must never import torch or triton (a contract test checks).
"""

from qmoe_doctor.cli.app import app, main

__all__ = ["app", "main"]
