"""Adapters that plug flatgrad's reducer into training engines."""
