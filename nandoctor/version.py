"""nandoctor's version, in a module of its own so that every layer can name it without importing the package's
`__init__` (which reaches up to `nandoctor.watch`)."""

__version__ = "0.1.0"
