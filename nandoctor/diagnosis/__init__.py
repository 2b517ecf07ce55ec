"""From a detected fault to the report's findings: the replay that names op, layer and samples, the causes
read back, and `assemble`, the one post-run sequence every way in calls."""
