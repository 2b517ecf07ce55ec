"""Renderers: the same Report as a rich terminal view, JSON (the contract) and Markdown; plus bundles."""
