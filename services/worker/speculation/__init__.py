"""Speculative decoding on the worker (placeholder; see the glossary below once written)."""
