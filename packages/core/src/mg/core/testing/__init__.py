"""Helpers for tests that compare mg with reference implementations."""
