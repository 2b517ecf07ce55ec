"""Verified remedies: candidate fixes replayed from a snapshot before the fault, judged, and written as
the change the user makes."""
