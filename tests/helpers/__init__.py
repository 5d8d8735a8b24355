"""Helpers for the RPC tests: peer processes and polling utilities."""
