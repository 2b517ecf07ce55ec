"""reproduce.py's source: copied verbatim into every bundle, so it imports nothing from nandoctor."""
