"""Checkpoints the project makes itself: tiny random models for tests and the embedded default."""
