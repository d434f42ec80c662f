"""The library's version, recorded in every checkpoint it writes (``manifest.json``, the save marker).

A module of its own (layer 1) so that the modules writing it need not import the package root.
"""

__version__ = "0.1.0"
