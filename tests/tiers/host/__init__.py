"""Tests of the host tier (a package so its conftest has a module name of its own)."""
