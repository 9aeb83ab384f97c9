"""Packaged demo sources (``demo:NAME``)."""
